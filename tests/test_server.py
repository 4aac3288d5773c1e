"""`k26jax serve` as a client sees it: a real server process on 127.0.0.1 and the official openai client.

One server (tiny checkpoint, float32, DDTree with --budget auto among three candidates, 4 slots) serves most
tests; a second one (AR), started at the same time, holds the fault-injection seam and is stopped by SIGTERM. Both
run on one device (the
sharded server is tests/test_distributed.py's, on a (2, 4) mesh of two processes). Greedy outputs are checked against
`k26jax.generate` under DESIGN's near-tie rule (compared up to the first position whose float32 top-1/top-2 margin
is < 1e-4).
"""

import asyncio
import concurrent.futures
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest

import k26jax
from k26jax.generation import generate
from k26jax.serve.app import Mailbox
from k26jax.serve.scheduler import FAULT_ENV
from k26jax.serve.text import TextStream
from k26jax.tokenizer import StreamDecoder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT = os.path.join(ROOT, "checkpoints", "tiny")
KEY = "sk-test-key"
MAIN = [
    "--devices",
    "1",
    "--method",
    "ddtree",
    "--budget",
    "auto",
    "--auto-candidates",
    "chain,ddtree8,ddtree16",  # three of the six keep the warm-up short (test_autobudget races all of them)
    "--max-batch",
    "4",
    "--max-len",
    "128",
    "--max-queue",
    "12",
]
NEW = 16
LONG = 100
rng = np.random.default_rng(0)
PROMPTS = [rng.integers(0, 700, 12).tolist() for _ in range(16)]  # token ids, all of one length
TEXT_PROMPTS = ["The quick brown fox", "Kimi K2.6 is a model that"]


class ServerProcess:
    """`python -m k26jax serve` on a free port of 127.0.0.1, its output in a log file."""

    def __init__(self, log_path, *args, env=None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": "highest", **(env or {})}
        cmd = [sys.executable, "-m", "k26jax", "serve", "--ckpt", CKPT, "--dtype", "float32", "--port", str(self.port)]
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([*cmd, *args, "--log-level", "warning"], stdout=self.log, stderr=self.log, env=env)

    def wait_ready(self, timeout=600):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{open(self.log_path).read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        pytest.fail(f"server not ready in {timeout}s:\n{open(self.log_path).read()}")

    def metrics(self, key=KEY) -> dict:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {key}"}).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(k26jax_\w+(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_idle(self, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            if m["k26jax_slots_in_use"] == 0 and m["k26jax_queue_depth"] == 0:
                return
            time.sleep(0.1)
        pytest.fail("server did not become idle")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """Both servers, started together so their warm-ups overlap with each other and with `trajectories`."""
    logs = tmp_path_factory.mktemp("serve")
    main = ServerProcess(logs / "main.log", *MAIN, "--api-key", KEY)
    ar_args = ["--method", "ar", "--max-batch", "2", "--max-len", "64", "--drain-timeout", "30", "--devices", "1"]
    ar = ServerProcess(logs / "ar.log", *ar_args, env={FAULT_ENV: "2"})
    yield main, ar
    main.stop()
    ar.stop()


@pytest.fixture(scope="module")
def server(processes):
    return processes[0]


@pytest.fixture(scope="module")
def model():
    return k26jax.load(CKPT, dtype="float32")


@pytest.fixture(scope="module")
def trajectories(server, model):
    """generate's greedy LONG tokens for PROMPTS (computed while the server warms up) and each one's safe length."""
    tokens = generate(model, PROMPTS, max_new_tokens=LONG, method="ar").tokens
    seqs = np.zeros((len(PROMPTS), len(PROMPTS[0]) + LONG), np.int32)
    for i, (p, t) in enumerate(zip(PROMPTS, tokens)):
        seqs[i, : len(p) + len(t)] = p + t
    logits = np.asarray(model.logits(seqs))
    safe = []
    for i, (p, t) in enumerate(zip(PROMPTS, tokens)):
        top2 = np.sort(logits[i, len(p) - 1 : len(p) + len(t) - 1], -1)[:, -2:]
        ties = np.nonzero(top2[:, 1] - top2[:, 0] < 1e-4)[0]
        safe.append(int(ties[0]) if ties.size else len(t))
    return tokens, safe


@pytest.fixture(scope="module")
def refs(trajectories):
    """The first NEW greedy tokens of each prompt and how many of them are safe to compare."""
    tokens, safe = trajectories
    return [t[:NEW] for t in tokens], [min(s, NEW) for s in safe]


@pytest.fixture(scope="module")
def long_ones(trajectories, model):
    """Prompts whose LONG greedy tokens hold no EOS and no near tie: their streams run exactly LONG tokens."""
    tokens, safe = trajectories
    idx = [i for i, t in enumerate(tokens) if len(t) == safe[i] == LONG and t[-1] not in model.cfg.eos_token_ids]
    assert len(idx) >= 4, "too few prompts decode LONG tokens without EOS"
    return idx


@pytest.fixture(scope="module")
def client(server, trajectories):
    server.wait_ready()
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def text_of(model, tokens, final=True) -> str:
    """What the server sends for these tokens: UTF-8-safe decoding with EOS hidden."""
    dec = StreamDecoder(model.tokenizer)
    text = dec.feed([t for t in tokens if t not in model.cfg.eos_token_ids])
    return text + dec.flush() if final else text


def assert_greedy_text(model, got: str, tokens, safe: int):
    if safe >= len(tokens):
        assert got == text_of(model, tokens)
    else:
        assert got.startswith(text_of(model, tokens[:safe], final=False))


def complete(client, prompt, max_tokens=NEW, **kw):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


# ---- endpoints and equality with generate ----------------------------------------------------------------------
def test_models_and_health(client, server):
    (card,) = client.models.list().data
    assert card.id == "tiny" and card.max_model_len == 128 - 8  # --max-len less the draft tree's L + 1 rows
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # no key needed


def test_completion_equals_generate_streamed_and_not(client, model, refs):
    tokens, safe = refs
    for i in (0, 1):
        res = complete(client, PROMPTS[i])
        assert_greedy_text(model, res.choices[0].text, tokens[i], safe[i])
        assert res.choices[0].finish_reason == ("stop" if tokens[i][-1] in model.cfg.eos_token_ids else "length")
        assert res.usage.prompt_tokens == len(PROMPTS[i]) and res.usage.completion_tokens == len(tokens[i])
        assert res.usage.total_tokens == res.usage.prompt_tokens + res.usage.completion_tokens
        chunks = list(complete(client, PROMPTS[i], stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == res.choices[0].text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens[i])
        assert all(c.usage is None for c in chunks[:-1])
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == res.choices[0].finish_reason


def test_text_prompts_a_list_of_prompts_and_chat_are_their_token_ids(client, model):
    tok = model.tokenizer
    res = client.completions.create(model="tiny", prompt=TEXT_PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in res.choices] == [0, 1]
    for choice, text in zip(res.choices, TEXT_PROMPTS):
        assert choice.text == complete(client, tok.encode(text), 8).choices[0].text
    assert res.usage.prompt_tokens == sum(len(tok.encode(p)) for p in TEXT_PROMPTS)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = tok.apply_chat_template(messages)
    want = complete(client, ids, 10)
    res = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert res.choices[0].message.role == "assistant"
    assert res.choices[0].message.content == want.choices[0].text
    assert res.usage == want.usage
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == res.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == res.choices[0].finish_reason


def test_logprobs_are_the_targets_log_softmax(client, model, refs):
    tokens, _ = refs
    res = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = res.choices[0].logprobs.content
    assert len(content) == res.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and np.exp(values).sum() <= 1 + 1e-5
        assert entry.logprob == pytest.approx(values[0], abs=1e-6)  # greedy: the chosen token is the top one
    res = complete(client, PROMPTS[0], max_tokens=2, logprobs=2)
    logits = np.asarray(model.logits(np.array([PROMPTS[0]])))[0, -1].astype(np.float64)
    logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    assert res.choices[0].logprobs.token_logprobs[0] == pytest.approx(logp[tokens[0][0]], abs=1e-4)
    assert len(res.choices[0].logprobs.top_logprobs[0]) <= 2


def test_stop_string_ends_the_text_before_it(client, model, refs):
    tokens, safe = refs
    i = next(i for i in range(len(PROMPTS)) if safe[i] == len(tokens[i]) and len(text_of(model, tokens[i])) > 8)
    full = text_of(model, tokens[i])
    stop = full[5:8]
    res = complete(client, PROMPTS[i], stop=[stop, "\x00never"])
    assert res.choices[0].text == full[: full.index(stop)]
    assert res.choices[0].finish_reason == "stop"
    assert res.usage.completion_tokens <= len(tokens[i])
    streamed = "".join(c.choices[0].text for c in complete(client, PROMPTS[i], stop=stop, stream=True) if c.choices)
    assert streamed == res.choices[0].text


def test_sampling_is_seeded(client):
    kw = dict(max_tokens=12, temperature=1.0, top_p=0.9)
    a = client.completions.create(model="tiny", prompt=PROMPTS[3], seed=11, **kw).choices[0].text
    b = client.completions.create(model="tiny", prompt=PROMPTS[3], seed=11, **kw).choices[0].text
    assert a == b


# ---- continuous batching --------------------------------------------------------------------------------------
def test_16_concurrent_requests_through_4_slots_each_equal_its_solo_result(client, server, model, refs):
    tokens, safe = refs
    server.wait_idle()
    before = server.metrics()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: complete(client, PROMPTS[i]), range(16)))
    assert len({r.id for r in results}) == 16
    for i, r in enumerate(results):
        assert_greedy_text(model, r.choices[0].text, tokens[i], safe[i])
        assert r.usage.completion_tokens == len(tokens[i])
    after = server.metrics()
    served = sum(
        after[f'k26jax_requests_total{{outcome="{o}"}}'] - before[f'k26jax_requests_total{{outcome="{o}"}}']
        for o in ("stop", "length")
    )
    assert served == 16


def test_a_short_request_finishes_first_in_a_freed_slot_and_the_long_ones_are_not_restarted(
    client, server, model, trajectories, long_ones
):
    tokens, _ = trajectories
    server.wait_idle()
    inserts = lambda m: sum(v for k, v in m.items() if k.startswith("k26jax_insert_seconds_count"))
    before, order = inserts(server.metrics()), []

    def run(name, i, max_tokens):
        chunks = list(complete(client, PROMPTS[i], max_tokens, stream=True, stream_options={"include_usage": True}))
        order.append(name)
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        longs = [pool.submit(run, f"long{k}", i, LONG) for k, i in enumerate(long_ones[:3])]
        pool.submit(run, "medium", long_ones[3], 6)
        deadline = time.monotonic() + 60
        while server.metrics()["k26jax_slots_in_use"] < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        short = pool.submit(run, "short", 0, 3)  # every slot is busy: it waits for the medium one's
        short.result()
        results = [f.result() for f in longs]
    assert order.index("short") < min(order.index(f"long{k}") for k in range(3)), order
    assert inserts(server.metrics()) == before + 5  # each request was prefilled once: none restarted
    for i, (text, n) in zip(long_ones, results):
        assert n == LONG and text == text_of(model, tokens[i])


def test_compile_count_is_flat_across_prompt_lengths_and_sampling_settings(client, server):
    server.wait_idle()
    before = server.metrics()["k26jax_compilations_total"]
    assert before > 0  # the warm-up's
    for n in (3, 17, 40, 70, 110):
        client.completions.create(model="tiny", prompt=list(range(1, n + 1)), max_tokens=2, temperature=0)
    client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0.7, top_p=0.5, logprobs=5)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 50}], max_tokens=3)
    assert server.metrics()["k26jax_compilations_total"] == before


def test_a_cancelled_stream_frees_its_slot(client, server, long_ones):
    server.wait_idle()
    before = server.metrics()['k26jax_requests_total{outcome="cancelled"}']
    streams = [complete(client, PROMPTS[i], LONG, stream=True) for i in long_ones[:4]]
    for s in streams:
        next(iter(s))  # each holds a slot now
    streams[0].close()
    res = complete(client, PROMPTS[0], 3)  # needs the freed slot: the other three run LONG tokens
    assert res.choices[0].finish_reason == "length"
    left = server.metrics()
    assert left['k26jax_requests_total{outcome="cancelled"}'] == before + 1
    assert left["k26jax_slots_in_use"] == 3  # the other three streams are still decoding
    for s in streams[1:]:
        s.close()
    server.wait_idle()


# ---- bad input, auth, backpressure ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": list(range(1, 125))}, "prompt"),
        ({"prompt": "hi", "max_tokens": 125}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -0.5}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "n": 2}, "n"),
        ({"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "hi", "echo": True}, "echo"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "frobnicate": 1}, "frobnicate"),
        ({"prompt": [5000]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ({"messages": [], "max_tokens": 4}, "messages"),
        ({"prompt": "hi", "max_tokens": "4"}, "max_tokens"),  # strict: not coerced
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ],
)
def test_bad_requests_get_400_naming_the_field(client, server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server.url + path, json={"model": "tiny", **body}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and param in err["message"] + str(param)


def test_malformed_json_unknown_model_and_the_server_stays_healthy(client, server):
    rejected = 'k26jax_requests_total{outcome="rejected"}'
    before = server.metrics()[rejected]
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": ', headers=auth)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b"[1, 2]", headers=auth)
    assert r.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    assert httpx.get(server.url + "/nowhere", headers=auth).status_code == 404
    assert server.metrics()[rejected] == before + 5  # two malformed bodies, the unknown model and path, T < 0
    assert httpx.get(server.url + "/health").status_code == 200
    assert complete(client, PROMPTS[0], 2).choices[0].finish_reason == "length"


def test_a_wrong_or_missing_api_key_gets_401(server, client):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(server.url + path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_full_queue_answers_503_with_retry_after(server, client):
    server.wait_idle()
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}

    def post(_):
        return httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        responses = list(pool.map(post, range(30)))
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 503} and codes.count(200) >= 16, codes
    for r in responses:
        if r.status_code == 503:
            assert r.headers["Retry-After"] and r.json()["error"]["type"] == "server_error"
    assert server.metrics()['k26jax_requests_total{outcome="overloaded"}'] == codes.count(503)


def test_metrics_count_what_was_served(server, client):
    server.wait_idle()
    before = server.metrics()
    res = complete(client, PROMPTS[2], 5)
    after = server.metrics()
    outcome = f'k26jax_requests_total{{outcome="{res.choices[0].finish_reason}"}}'
    assert after[outcome] == before[outcome] + 1
    assert after["k26jax_prompt_tokens_total"] == before["k26jax_prompt_tokens_total"] + len(PROMPTS[2])
    assert after["k26jax_generation_tokens_total"] == before["k26jax_generation_tokens_total"] + 5
    assert after["k26jax_step_seconds_count"] > before["k26jax_step_seconds_count"]
    assert after["k26jax_accept_length_count"] > before["k26jax_accept_length_count"]
    assert after["k26jax_time_to_first_token_seconds_count"] == before["k26jax_time_to_first_token_seconds_count"] + 1
    assert after["k26jax_queue_depth"] == 0
    spent = lambda m, a: m[f'k26jax_engine_seconds_total{{activity="{a}"}}']
    assert spent(after, "host") > spent(before, "host") and spent(after, "device_wait") > spent(before, "device_wait")
    steps = after["k26jax_step_seconds_count"] - before["k26jax_step_seconds_count"]
    chosen = lambda m: sum(v for k, v in m.items() if k.startswith("k26jax_budget_choices_total{"))
    assert chosen(after) - chosen(before) == steps  # --budget auto: every step's candidate is counted
    assert any(k.startswith("k26jax_budget_step_ms{") for k in after) and "k26jax_budget_calibration_gamma" in after


# ---- text: UTF-8 and stop strings ---------------------------------------------------------------------------------
def test_text_stream_holds_back_partial_stops_and_split_characters(model):
    tok = model.tokenizer
    tokens = [tok.encoding.encode_single_token(bytes([b])) for b in "añb STOP".encode()]  # ñ is two bytes
    ts = TextStream(tok, stops=["ST", "xyz"])
    pieces = [ts.feed(t) for t in tokens]
    assert pieces[1] == "" and pieces[2] == "ñ"  # the first byte of ñ waits for the second
    assert "".join(pieces) == "añb " and ts.stopped
    ts = TextStream(tok, stops=["b S"])
    assert "".join(ts.feed(t) for t in tokens[:4]) == "añ" and ts.finish() == "b"  # held "b", no match: released


# ---- faults and shutdown (a second server: AR, the fault seam set) -------------------------------------------------
@pytest.fixture(scope="module")
def ar_server(processes):
    return processes[1].wait_ready()


def test_an_injected_step_fault_fails_its_requests_with_500_and_the_next_succeeds(ar_server):
    c = openai.OpenAI(base_url=ar_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0)  # step 2 raises
    assert e.value.status_code == 500 and "injected fault" in e.value.message
    res = c.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert res.choices[0].finish_reason == "length" and res.usage.completion_tokens == 10
    m = ar_server.metrics()
    assert m['k26jax_requests_total{outcome="error"}'] == 1 and m['k26jax_requests_total{outcome="length"}'] == 1
    assert httpx.get(ar_server.url + "/health").status_code == 200


def test_sigterm_drains_the_requests_in_flight_and_exits(ar_server):
    c = openai.OpenAI(base_url=ar_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def run(i):
        chunks = list(complete(c, PROMPTS[i], 40, stream=True, stream_options={"include_usage": True}))
        return chunks[-1].usage.completion_tokens, [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run, i) for i in range(2)]
        deadline = time.monotonic() + 60
        while ar_server.metrics()["k26jax_slots_in_use"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        start = time.monotonic()
        ar_server.proc.send_signal(signal.SIGTERM)
        assert [f.result() for f in futures] == [(40, "length")] * 2
    with pytest.raises((openai.APIConnectionError, openai.APIStatusError)):
        complete(c, PROMPTS[0], 2)
    assert ar_server.proc.wait(timeout=40) == 0
    assert time.monotonic() - start < 35
    assert "server stopped" in open(ar_server.log_path).read()


def test_the_mailbox_hands_a_batch_of_posts_to_the_loop_in_order_in_one_wake_up():
    """The engine thread's posts reach each request's queue in order; posts made before the loop runs share one
    wake-up; once the loop is closed a post raises (the scheduler then cancels that request)."""
    loop = asyncio.new_event_loop()
    wakes, call = [], loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: wakes.append(a) or call(*a)
    mailbox, queues = Mailbox(loop), (asyncio.Queue(), asyncio.Queue())
    engine = threading.Thread(target=lambda: [mailbox.post(queues[i % 2], i) for i in range(10)])
    engine.start()
    engine.join()
    loop.run_until_complete(asyncio.sleep(0))
    assert [[q.get_nowait() for _ in range(q.qsize())] for q in queues] == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert len(wakes) == 1
    mailbox.post(queues[0], 10)  # after the hand-over: a wake-up of its own
    loop.run_until_complete(asyncio.sleep(0))
    assert queues[0].get_nowait() == 10 and len(wakes) == 2
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        mailbox.post(queues[0], 11)
