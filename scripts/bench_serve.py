"""Service benchmark of `k26jax serve`: closed-loop streaming clients at concurrency C, the analog of the seed's
service_baseline (SGLang + DDTree on 8x RTX PRO 6000: 138.7 / 322 / 466 / 517 tok/s at C = 1 / 4 / 8 / 10; the
seed states no workload).

Workload (ours): prompts of --prompt-len tokens (the mini pair's held-out prompts, --prompts heldout: each held-out
stdlib file's first tokens under the served tokenizer; an .npy of ids; or random ids), --max-tokens new tokens
each, temperature 0, through /v1/completions with stream=true; C clients each send their next request when the
last one ends, for --duration seconds per C (requests in flight at the end finish and count). Reported per C:
output tok/s, requests/s, time to first token, time per output token and the gap between streamed chunks (one
chunk = one step's tokens), p50 / p99, and from the server's /metrics: tau (tokens per slot-step), mean step and
insert (prefill) time, compilations, and how the engine thread spent the time (host work, waiting on the device,
idle).

--bare times the bare step loop at each C with the server's own Decoder settings (a subprocess, before the server
starts, so the two never share the device): C prompts inserted, then --bare-steps `Decoder.step` calls back to back
with every slot active; tok/s over those steps. Then the same workload as the server's without the server
(`bare_workload`: requests of --max-tokens, a finished slot refilled by an insert at once, each step read to the
host): server / bare-workload is the cost of HTTP, scheduling and streaming alone. --stall-len N measures how
one N-token prefill delays the other streams' next chunk. --synthetic serves a K2.6-width random model
(bench_e2e's configs, --layers deep) whose acceptance is k26jax.synthetic's calibrated drafter (the chain's
E[tau] = --tau at b = 8, each budget earning its own tree's), so scheduling costs show at real shapes; --budget
auto serves and bare-loops the auto choice (its bare loop reads each step's survival to the host, as the server
does).

GPU (the server and the clients on one machine). The device has no package registry: `bash scripts/device_wheels.sh`
here puts the server's and the client's wheels in .whl (6.5 MB); carry .whl and begin the device command with
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
then:
  python scripts/bench_serve.py --launch --bare --prompts heldout --label mini_ddtree -- --ckpt checkpoints/mini
  python scripts/bench_serve.py --synthetic --layers 8 --tau 5.3 --bare --label k26d8_ddtree
  python scripts/bench_serve.py --url http://127.0.0.1:8000 --label live   # a server already running
CPU smoke run (its timings mean nothing):
  python scripts/bench_serve.py --launch --bare --duration 3 --concurrency 1,2 --prompt-len 32 --max-tokens 16 \\
      --stall-len 100 --out /tmp/serve_cpu.json -- --dtype float32 --max-len 128 --max-batch 2 --budget 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

CHILD_ENV = dict(os.environ)  # the server and the bare loop get the device: the environment as it came
if not {"--synthetic-server", "--bare-only"} & set(sys.argv):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the client never takes the device from the server

import harness  # noqa: E402
import httpx  # noqa: E402
import numpy as np  # noqa: E402

ENGINE_ACTIVITIES = ("host", "device_wait", "idle")
SEED_SERVICE_8X_PRO6000 = {1: 138.7, 4: 322.0, 8: 466.0, 10: 517.0}  # tok/s, the seed's service_baseline
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the engine the server runs (for --bare and --synthetic-server) -----------------------------------------------
def serve_args(args):
    """The `k26jax serve` arguments: --launch's after `--`, or --synthetic's settings."""
    from k26jax import cli

    if args.synthetic or args.synthetic_server:
        extra = ["--method", args.method, "--max-batch", str(args.max_batch)]
        extra += ["--budget", str(args.budget)] if args.method == "ddtree" else []
        extra += ["--max-len", str(args.max_len), "--max-queue", str(args.max_queue), "--log-level", "warning"]
        extra += ["--port", str(args.port)]
        return cli.parse_args(["serve", *extra])
    return cli.parse_args(["serve", *args.serve_args])


class IdTokenizer:
    """A random model has no tokenizer: token id i reads as " i" (prompts go as ids)."""

    class encoding:
        @staticmethod
        def decode_bytes(ids):
            return "".join(f" {i}" for i in ids).encode()

        @staticmethod
        def decode_single_token_bytes(i):
            return f" {i}".encode()

    def encode(self, text):
        raise ValueError("this synthetic model takes prompts as token ids")

    def apply_chat_template(self, messages):
        raise ValueError("this synthetic model has no chat template")


def synthetic_engine(args, sargs):
    """(Decoder, params, drafter params): bench_e2e's K2.6-width target (--layers deep, its router's bias balanced
    as a trained K2.6's is) and DFlash drafter with random weights made on the device, and its calibrated
    synthetic acceptance (the chain's E[tau] = --tau at b = 8,
    each budget earning its tree's); --budget auto gives an AutoDecoder over the same pair."""
    import bench_e2e
    import jax
    import jax.numpy as jnp

    from k26jax import autobudget, engine, ops, routing, synthetic
    from k26jax.model import drafter as drafter_lib
    from k26jax.model import target
    from k26jax.serve import server
    from k26jax.step_cost import kimi_drafter_config

    tiny = args.synthetic_preset == "tiny"
    cfg = bench_e2e.target_config(args.synthetic_preset, args.layers)
    dcfg = kimi_drafter_config(cfg, tiny)
    dtype = jnp.float32 if tiny else jnp.bfloat16
    params, dparams = jax.jit(lambda: (target.init_params(cfg, 0, dtype), drafter_lib.init_params(dcfg, 1, dtype)))()
    probe_impls = dataclasses.replace(ops.Impls.auto(), probe=routing.ExpertProbe(cfg.n_routed_experts))
    params, router = bench_e2e.balance_router(params, cfg, probe_impls, args.seed, tiny)  # as a trained K2.6's
    print(f"[serve] router balanced: {json.dumps(router)}", file=sys.stderr, flush=True)
    d = dcfg if sargs.method != "ar" else None
    profile = synthetic.fit_profile(args.tau, 8, vocab=cfg.vocab_size)
    drafter, acceptor = synthetic.synthetic_pair(profile, 0, base=engine.DFlashDraft())
    kw = dict(drafter=drafter, acceptor=acceptor) if d is not None else {}
    kind = autobudget.AutoDecoder if sargs.budget == "auto" else engine.Decoder
    dec = kind(cfg, d, server.step_config(sargs, cfg, d), ops.Impls.auto(), **kw)
    return dec, params, dparams if d is not None else None


def run_synthetic_server(args) -> int:
    from k26jax.serve import server

    sargs = serve_args(args)
    sock = server.bind(sargs.host, sargs.port)
    dec, params, dparams = synthetic_engine(args, sargs)
    name = f"k26-depth{args.layers}-random" if args.synthetic_preset != "tiny" else "tiny-random"
    sched, config = server.start(sargs, dec, params, dparams, IdTokenizer(), name, sock)
    return server.serve(sched, config, sargs.drain_timeout, sock)


def bare_loop(args) -> dict:
    """tok/s of `Decoder.step` back to back at each C, every slot active (its limit the whole cache), no host work
    between steps: --bare-steps steps after one warm step, one wait at the end."""
    import jax

    sargs = serve_args(args)
    if args.synthetic:
        dec, params, dparams = synthetic_engine(args, sargs)
    else:
        from k26jax.serve import server

        dec, params, dparams, _ = server.load_decoder(sargs)
    prompts = load_prompts(args, dec.cfg.vocab_size)
    room = sargs.max_len - args.prompt_len - dec.sc.depth - 1
    steps = min(args.bare_steps, room // (dec.sc.depth + 1) - 1)
    rows = {}
    for C in args.concurrency:
        state = _empty(dec, params, dparams, C, sargs.max_len)
        for c in range(C):
            state = _insert(args, sargs, dec, params, dparams, state, c, prompts, c, room)
        step = dec.step
        if sargs.budget == "auto":
            dec.prepare(params, dparams, state)

            def step(params, dparams, state):
                state = dec.step(params, dparams, state)
                dec.observe(jax.device_get({f: getattr(state, f) for f in dec.FIELDS}), np.zeros(C, bool))
                return state

        state = step(params, dparams, state)  # compile and warm
        start_out = np.asarray(state.num_out).copy()
        t0 = time.perf_counter()
        for _ in range(steps):
            state = step(params, dparams, state)
        num_out = np.asarray(state.num_out)
        seconds = time.perf_counter() - t0
        tokens = int((num_out - start_out).sum())
        rows[C] = dict(C=C, steps=steps, tokens=tokens, step_ms=1e3 * seconds / steps, tok_s=tokens / seconds)
        rows[C]["tau"] = tokens / (steps * C)
        del state
        rows[C].update(bare_workload(args, sargs, dec, params, dparams, prompts, step, C, 4 * steps))
        print(
            f"[bare] C={C}: {rows[C]['tok_s']:.1f} tok/s, tau {rows[C]['tau']:.2f}; with the workload's inserts "
            f"{rows[C]['workload_tok_s']:.1f} tok/s",
            file=sys.stderr,
            flush=True,
        )
    return dict(device=f"{jax.device_count()} x {jax.devices()[0].device_kind}", steps=steps, rows=rows)


def bare_workload(args, sargs, dec, params, dparams, prompts, step, C: int, steps: int) -> dict:
    """The server's workload without the server: C slots each decoding a request of --max-tokens new tokens, a
    finished slot refilled at once by an insert of the next prompt, each step's tokens and done flags read to the
    host (as the scheduler does), over `steps` steps after one warm step. Against this the server's overhead is
    HTTP, scheduling and streaming alone; against the steps-only loop it also pays the prefills and idle slots."""
    import jax

    state = _empty(dec, params, dparams, C, sargs.max_len)
    for c in range(C):
        state = _insert(args, sargs, dec, params, dparams, state, c, prompts, c, args.max_tokens)
    # warm: the step, then an insert into a state a step left (committed arrays where a parameter is, which
    # compile an insert of their own, as the server's warm-up knows)
    state = step(params, dparams, state)
    state = _insert(args, sargs, dec, params, dparams, state, 0, prompts, 0, args.max_tokens)
    state = step(params, dparams, state)
    tokens, inserts, t0 = 0, 0, time.perf_counter()
    for _ in range(steps):
        state = step(params, dparams, state)
        host = jax.device_get({"num_emitted": state.num_emitted, "done": state.done})
        tokens += int(host["num_emitted"].sum())
        for slot in map(int, np.flatnonzero(host["done"])):
            served = C + inserts
            state = _insert(args, sargs, dec, params, dparams, state, slot, prompts, served, args.max_tokens)
            tokens, inserts = tokens + int(np.asarray(state.num_emitted)[slot]), inserts + 1
    seconds = time.perf_counter() - t0
    return dict(workload_steps=steps, workload_inserts=inserts, workload_tok_s=tokens / seconds)


def _empty(dec, params, dparams, C: int, max_len: int):
    import jax

    ctx_dtype = jax.tree.leaves(dparams)[0].dtype if dparams is not None else None
    return dec.empty(batch=C, max_len=max_len, dtype=params["embed"].dtype, ctx_dtype=ctx_dtype)


def _insert(args, sargs, dec, params, dparams, state, slot: int, prompts, n: int, max_new: int):
    """Insert prompt n (of the workload's, cycling) into `slot`, seeded n, as the server's scheduler inserts."""
    from k26jax.serve.scheduler import bucket_for, insert_args

    ids = np.zeros((1, bucket_for(args.prompt_len, sargs.max_len)), np.int32)
    ids[0, : args.prompt_len] = prompts[n % len(prompts)]
    extra = insert_args(slot, ids, args.prompt_len, max_new, args.temperature, 1.0, n)
    return dec.insert(params, dparams, state, *extra)


# ---- the workload ---------------------------------------------------------------------------------------------
def load_prompts(args, vocab_size: int) -> list[list[int]]:
    """--prompt-len ids per prompt: random (below min(vocab_size, 1000)), the first ids of the held-out stdlib files
    under the served checkpoint's tokenizer ("heldout", --launch: the mini pair's evaluation prompts), or an .npy."""
    if args.prompts == "heldout":
        from k26jax.tokenizer import Tokenizer
        from k26jax.train import corpus

        if not args.launch:
            raise SystemExit("--prompts heldout: needs --launch (it reads the served checkpoint's tokenizer)")
        ckpt = serve_args(args).ckpt
        ids, _ = corpus.heldout_prompts(Tokenizer(ckpt), n=64, prompt_tokens=args.prompt_len)
        if not len(ids):
            raise SystemExit(f"--prompts heldout: no held-out file has {args.prompt_len} tokens under {ckpt}")
        return ids.tolist()
    if args.prompts == "random":
        rng = np.random.default_rng(args.seed)
        return [rng.integers(0, min(vocab_size, 1000), args.prompt_len).tolist() for _ in range(64)]
    rows = np.load(args.prompts)
    if rows.ndim != 2 or rows.shape[1] < args.prompt_len:
        raise SystemExit(f"--prompts {args.prompts}: need an int array [n, >= {args.prompt_len}], got {rows.shape}")
    return rows[:, : args.prompt_len].astype(int).tolist()


@dataclasses.dataclass
class Sample:
    sent: float
    chunks: list[float]
    tokens: int = 0
    done: float = 0.0
    error: str | None = None


async def one_request(http, url, headers, body, s: Sample | None = None) -> Sample:
    """One streamed completion; chunk arrival times go into s as they come (so a cancelled request keeps them)."""
    s = s or Sample(time.perf_counter(), [])
    s.sent = time.perf_counter()
    try:
        async with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    s.error = event["error"]["message"]
                elif event.get("choices") and event["choices"][0]["text"]:
                    s.chunks.append(time.perf_counter())
                elif event.get("usage"):
                    s.tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"
    s.done = time.perf_counter()
    return s


async def closed_loop(url, headers, body_for, C: int, duration: float) -> tuple[list[Sample], float, float]:
    """C clients, each sending its next request when its last ends, until duration has passed."""
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=C + 2, max_keepalive_connections=C + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        start = time.perf_counter()
        deadline = start + duration

        async def client(k: int):
            while time.perf_counter() < deadline:
                samples.append(await one_request(http, url, headers, body_for(k)))
                k += C

        await asyncio.gather(*(client(k) for k in range(C)))
    return samples, start, time.perf_counter()


async def warm_up(url, headers, body):
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        s = await one_request(http, url, headers, body)
    if s.error:
        raise SystemExit(f"the warm-up request failed: {s.error}")


def pct(xs, q):
    return float(np.percentile(xs, q)) * 1e3 if len(xs) else None


def summarize(C: int, samples: list[Sample], start: float, end: float) -> dict:
    ok = [s for s in samples if s.error is None and s.chunks]
    ttft = [s.chunks[0] - s.sent for s in ok]
    tpot = [(s.chunks[-1] - s.chunks[0]) / (s.tokens - 1) for s in ok if s.tokens > 1]
    gaps = [b - a for s in ok for a, b in zip(s.chunks, s.chunks[1:])]
    tokens = sum(s.tokens for s in ok)
    return dict(
        C=C,
        seconds=end - start,
        requests=len(ok),
        errors=len(samples) - len(ok),
        first_error=next((s.error for s in samples if s.error), None),
        output_tokens=tokens,
        output_tok_s=tokens / (end - start),
        requests_per_s=len(ok) / (end - start),
        ttft_ms_p50=pct(ttft, 50),
        ttft_ms_p99=pct(ttft, 99),
        tpot_ms_p50=pct(tpot, 50),
        tpot_ms_p99=pct(tpot, 99),
        itl_ms_p50=pct(gaps, 50),
        itl_ms_p99=pct(gaps, 99),
    )


def scrape(url, headers) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", headers=headers, timeout=30).text.splitlines():
        m = re.match(r"^(k26jax_\w+)(\{[^}]*\})? (\S+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def server_side(before: dict, after: dict) -> dict:
    d = lambda k: after.get(k, 0.0) - before.get(k, 0.0)
    insert_s = sum(d(k) for k in after if k.startswith("k26jax_insert_seconds_sum"))
    inserts = sum(d(k) for k in after if k.startswith("k26jax_insert_seconds_count"))
    return dict(
        tau=d("k26jax_accept_length_sum") / max(d("k26jax_accept_length_count"), 1),
        step_ms_mean=1e3 * d("k26jax_step_seconds_sum") / max(d("k26jax_step_seconds_count"), 1),
        steps=d("k26jax_step_seconds_count"),
        insert_ms_mean=1e3 * insert_s / max(inserts, 1),
        compilations=d("k26jax_compilations_total"),
        engine_seconds={a: d(f'k26jax_engine_seconds_total{{activity="{a}"}}') for a in ENGINE_ACTIVITIES},
    )


async def prefill_stall(url, headers, stream_body, long_body, C: int, settle: float) -> dict:
    """C long streams run; one long prompt arrives; the largest gap between the streams' chunks while it is
    prefilled (until its first token), against their median gap before it. The streams are then cancelled."""
    limits = httpx.Limits(max_connections=C + 3)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        samples = [Sample(time.perf_counter(), []) for _ in range(C)]
        streams = [asyncio.ensure_future(one_request(http, url, headers, stream_body(k), samples[k])) for k in range(C)]
        await asyncio.sleep(settle)
        long = await one_request(http, url, headers, long_body)
        await asyncio.sleep(0.5)
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    prefilled = long.chunks[0] if long.chunks else long.done
    gaps = [(a, b) for s in samples for a, b in zip(s.chunks, s.chunks[1:])]
    before = [b - a for a, b in gaps if b < long.sent]
    during = [b - a for a, b in gaps if b > long.sent and a < prefilled]
    return dict(
        C=C,
        long_prompt_tokens=len(long_body["prompt"]),
        long_ttft_ms=(prefilled - long.sent) * 1e3,
        median_gap_ms=pct(before, 50),
        max_gap_during_prefill_ms=max(during) * 1e3 if during else None,
        error=long.error or next((s.error for s in samples if s.error), None),
    )


# ---- the server ---------------------------------------------------------------------------------------------------
class Launched:
    """A server subprocess on a free port; its device from its start-up line."""

    def __init__(self, cmd, log_path):
        self.log_path, self.log = log_path, open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=CHILD_ENV)

    def wait(self, url, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}):\n{open(self.log_path).read()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit(f"the server was not up in {timeout}s:\n{open(self.log_path).read()[-3000:]}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
        return open(self.log_path).read()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_bare_subprocess(args, workdir) -> dict:
    out = os.path.join(workdir, "bare.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--bare-only", "--bare-out", out, *sys.argv[1:]]
    subprocess.run(cmd, check=True, env=CHILD_ENV)
    with open(out) as f:
        return json.load(f)


# ---- main ------------------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    from k26jax import cli

    argv = sys.argv[1:] if argv is None else argv
    serve_extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument("--launch", action="store_true", help="start `k26jax serve` with the arguments after --")
    where.add_argument("--synthetic", action="store_true", help="start a K2.6-width random model's server")
    where.add_argument("--synthetic-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bare-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bare-out", help=argparse.SUPPRESS)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="model id (default: the server's first)")
    ap.add_argument("--concurrency", default="1,4,8,10", type=lambda s: [int(c) for c in s.split(",")])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of closed-loop load per C")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument(
        "--prompts", default="random", help="'random', 'heldout' (with --launch) or an int .npy [n, >= prompt-len]"
    )
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bare", action="store_true", help="also time the bare step loop (--launch / --synthetic)")
    ap.add_argument("--bare-steps", type=int, default=32, help="steps timed per C in the bare loop")
    ap.add_argument("--stall-len", type=int, default=0, help="prompt tokens of the prefill-stall probe (0: none)")
    ap.add_argument("--ready-timeout", type=float, default=1800.0)
    ap.add_argument("--device", default=None, help="device to record with --url")
    ap.add_argument("--label", default="run")
    synth = ap.add_argument_group("--synthetic")
    synth.add_argument("--synthetic-preset", default="k26", choices=("k26", "tiny"))
    synth.add_argument("--layers", type=int, default=8)
    synth.add_argument("--tau", type=float, default=5.3)
    synth.add_argument("--method", default="ddtree", choices=("ddtree", "chain", "ar"))
    synth.add_argument("--budget", type=cli.budget_arg, default=32, help="DDTree nodes per step, or auto")
    synth.add_argument("--max-batch", type=int, default=10)
    synth.add_argument("--max-len", type=int, default=1024)
    synth.add_argument("--max-queue", type=int, default=256)
    synth.add_argument("--port", type=int, default=0)
    harness.add_record_args(ap, out=None)
    args = ap.parse_args(argv)
    args.serve_args = serve_extra
    if args.out is None:
        args.out = os.path.join(ROOT, "bench", "results", f"serve_{args.label}.json")
    if args.bare and args.url:
        ap.error("--bare needs --launch or --synthetic (the bench must know the server's engine)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.synthetic_server:
        return run_synthetic_server(args)
    if args.bare_only:
        harness.write_json(bare_loop(args), args.bare_out)
        return 0
    workdir = tempfile.mkdtemp(prefix="bench_serve_")
    bare = run_bare_subprocess(args, workdir) if args.bare else None
    server, url = None, args.url
    if not url:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        if args.synthetic:
            cmd = [sys.executable, os.path.abspath(__file__), "--synthetic-server", *sys.argv[1:], "--port", str(port)]
            cmd = [c for c in cmd if c not in ("--synthetic", "--bare")]
        else:
            cmd = [sys.executable, "-m", "k26jax", "serve", *args.serve_args, "--port", str(port)]
        server = Launched(cmd, os.path.join(workdir, "server.log"))
        server.wait(url, args.ready_timeout)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        card = httpx.get(url + "/v1/models", headers=headers).json()["data"][0]
        model, max_model_len = args.model or card["id"], card.get("max_model_len", args.prompt_len + args.max_tokens)
        vocab = 1000 if args.prompts == "random" else None
        prompts = load_prompts(args, vocab or 1 << 30)

        def body_for(k, max_tokens=args.max_tokens):
            return dict(
                model=model,
                prompt=prompts[k % len(prompts)],
                max_tokens=max_tokens,
                temperature=args.temperature,
                seed=k,
                stream=True,
                stream_options={"include_usage": True},
            )

        asyncio.run(warm_up(url, headers, body_for(0, 2)))
        rows = []
        for C in args.concurrency:
            before = scrape(url, headers)
            samples, start, end = asyncio.run(closed_loop(url, headers, body_for, C, args.duration))
            row = dict(summarize(C, samples, start, end), **server_side(before, scrape(url, headers)))
            if bare and str(C) in bare["rows"]:
                row["bare_tok_s"] = bare["rows"][str(C)]["tok_s"]
                row["server_over_bare"] = row["output_tok_s"] / row["bare_tok_s"]
                row["bare_workload_tok_s"] = bare["rows"][str(C)]["workload_tok_s"]
                row["server_over_bare_workload"] = row["output_tok_s"] / row["bare_workload_tok_s"]
            row["seed_service_tok_s"] = SEED_SERVICE_8X_PRO6000.get(C)
            print(json.dumps(row), flush=True)
            rows.append(row)
        stall = None
        if args.stall_len:
            rng = np.random.default_rng(args.seed + 1)
            long_body = dict(body_for(0, 1), prompt=rng.integers(0, 1000, args.stall_len).tolist())
            room = max_model_len - args.prompt_len - 16  # streams that outlast the probe (16 >= draft depth + 1)
            C = max(1, min(4, max(args.concurrency)) - 1)
            stall = asyncio.run(prefill_stall(url, headers, lambda k: body_for(k, room), long_body, C, settle=1.0))
            print(json.dumps(dict(stall=stall)), flush=True)
    finally:
        log = server.stop() if server else ""
    device = args.device or (bare or {}).get("device") or _device_from_log(log) or "unknown"
    record = harness.record_header(
        commit=args.commit,
        device=device,
        label=args.label,
        workload=dict(
            prompt_len=args.prompt_len,
            max_tokens=args.max_tokens,
            prompts=args.prompts,
            temperature=args.temperature,
            duration_s=args.duration,
            clients="closed loop, streaming /v1/completions",
        ),
        server=dict(url=args.url, serve_args=args.serve_args, synthetic=args.synthetic and vars(args)),
        rows=rows,
        bare=bare,
        prefill_stall=stall,
    )
    harness.write_json(record, args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _device_from_log(log: str) -> str | None:
    m = re.search(r"device=([^,;\n]+)", log)
    return m.group(1) if m else None


if __name__ == "__main__":
    sys.exit(main())
