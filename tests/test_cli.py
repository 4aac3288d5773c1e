"""The `k26jax` command line as a user runs it (a subprocess): a mistake is one `error:` line on stderr and exit
code 2, never a traceback; streamed text equals the full decode, multi-byte characters included."""

import os
import re
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from k26jax.api import DEFAULT_CKPT
from k26jax.tokenizer import StreamDecoder, Tokenizer

TINY = os.path.join(os.path.dirname(DEFAULT_CKPT), "tiny")


def run_cli(*args, timeout=300):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "k26jax", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--ckpt", "/nonexistent/ckpt", "--prompt", "hi"], "/nonexistent/ckpt: checkpoint directory does not exist"),
        (["--prompt", ""], "prompts[0] is empty"),
        (["--prompt", "hi", "--budget", "0"], "argument --budget: '0': use an integer in 1..4095 or 'auto'"),
        (["--prompt", "hi", "--budget", "auto", "--method", "chain"], "only --method ddtree builds a tree"),
        (["--prompt", "hi", "--drafter", "/nonexistent/drafter"], "/nonexistent/drafter"),
        (["--ckpt", TINY, "--prompt", "word " * 3000], "beyond the cache"),  # tiny: 4096 positions
    ],
    ids=["bad-path", "empty-prompt", "bad-budget", "auto-budget-for-chain", "missing-drafter", "prompt-too-long"],
)
def test_user_errors_are_one_line_and_exit_2(args, message):
    r = run_cli("generate", *args)
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]  # argparse's start with the prog name
    assert len(errors) == 1 and message in errors[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "args,said",
    [
        (["generate", "--prompt", "hi", "--budget", "100000"], "--budget: '100000': use an integer in 1..4095"),
        (["generate", "--prompt", "hi", "--method", "chain", "--budget", "64"], "--budget 64: only --method ddtree"),
        (["generate", "--prompt", "hi", "--temperature", "nan"], "--temperature: 'nan': not a finite number"),
        (["generate", "--prompt", "hi", "--temperature", "-1"], "--temperature: '-1': must be >= 0.0"),
        (["generate", "--prompt", "hi", "--top-p", "0"], "--top-p: '0': must be > 0.0 and <= 1.0"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens: '0': must be >= 1"),
        (["generate", "--prompt", "hi", "--devices", "-1"], "--devices: '-1': must be >= 0"),
        (["generate", "--prompt", "hi", "--profile", "FILE"], "cannot make this trace directory"),
        (["serve", "--port", "70000"], "--port: '70000': must be >= 0 and <= 65535"),
        (["serve", "--max-len", "0"], "--max-len: '0': must be >= 1"),
        (["serve", "--max-logprobs", "50"], "--max-logprobs: '50': must be >= 0 and <= 20"),
        (["serve", "--max-batch", "x"], "--max-batch: 'x': not an integer"),
        (["serve", "--drain-timeout", "-5"], "--drain-timeout: '-5': must be >= 0.0"),
        (["serve", "--method", "ar", "--budget", "auto"], "--budget auto: only --method ddtree"),
        (["generate", "--prompt", "hi", "--auto-candidates", "chain"], "--auto-candidates: only with --budget auto"),
        (["serve", "--budget", "auto", "--auto-candidates", "chain,tree8"], "'tree8': a candidate is 'chain' or"),
    ],
)
def test_bad_arguments_are_refused_by_name_before_anything_loads(tmp_path, capsys, args, said):
    from k26jax import cli

    (tmp_path / "FILE").write_text("")
    with pytest.raises(SystemExit) as e:
        cli.parse_args([str(tmp_path / a) if a == "FILE" else a for a in args])
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_serve_finds_a_busy_port_before_loading():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("serve", "--port", str(port), timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"--port {port}: cannot serve there (Address already in use)" in r.stderr
    assert "layers on" not in r.stderr  # nothing was loaded


def test_several_prompts_print_each_completion_whole():
    prompts = ["import os", "def f(x):"]
    r = run_cli("generate", "--method", "ar", "--max-new-tokens", "5", *[a for p in prompts for a in ("--prompt", p)])
    assert r.returncode == 0, r.stderr
    headers = [f"[{i}] {p!r} ->" for i, p in enumerate(prompts)]
    lines = r.stdout.splitlines()
    assert [line for line in lines if re.fullmatch(r"\[\d\] '.*' ->", line)] == headers, r.stdout
    first, second = lines.index(headers[0]), lines.index(headers[1])
    assert first == 0 and "".join(lines[1:second]).strip() and "".join(lines[second + 1 :]).strip(), r.stdout


def test_debug_shows_the_traceback():
    r = run_cli("--debug", "generate", "--ckpt", "/nonexistent/ckpt", "--prompt", "hi")
    assert r.returncode != 0 and "Traceback" in r.stderr and "FileNotFoundError" in r.stderr


def test_generate_streams_and_reports_tau():
    r = run_cli("generate", "--prompt", "Café 日本語", "--max-new-tokens", "6", "--method", "ar")
    assert r.returncode == 0, r.stderr
    assert "tau=1.00 (tokens per target pass; 1 = no speed-up)" in r.stderr
    assert "[k26jax] method=ar, 1 prompt(s)" in r.stderr  # AR has no tree budget
    assert "kernels: reference (jnp)" in r.stderr  # the library logs its backend and kernel path


def test_the_readme_command_speculates_on_the_embedded_pair():
    """The README's main command on the default checkpoint (the trained k26-mini pair): Python out, and more than
    one token per target pass (random weights give tau = 1.00)."""
    r = run_cli("generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "48")
    assert r.returncode == 0, r.stderr
    tau = float(re.search(r"tau=([\d.]+)", r.stderr).group(1))
    assert tau >= 1.5 and r.stdout.strip(), r.stderr


def test_budget_auto_decodes_and_reports_its_choices_and_chunks():
    """--budget auto as a user runs it: text out, and stderr says what auto chose and how many steps it ran a
    dispatch (that its tokens are AR's is tests/test_autobudget.py's, in process). A trial is a chunk of
    CHUNK_STEPS steps: 200 tokens reach the second candidate."""
    r = run_cli("generate", "--prompt", "def fibonacci(n):", "--max-new-tokens", "200", "--budget", "auto",
                "--auto-candidates", "chain,ddtree32")  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    said = re.search(r"budget auto: steps per candidate \{(.*)\}, measured step ms .*steps a dispatch", r.stderr)
    assert said and "chain" in said.group(1) and "ddtree32" in said.group(1), r.stderr


def test_profile_writes_a_trace_and_compiles_persist(tmp_path):
    cache = tmp_path / "cache"
    env = dict(os.environ, JAX_PLATFORMS="cpu", K26JAX_CACHE_DIR=str(cache))
    args = ["generate", "--prompt", "hi", "--max-new-tokens", "4", "--profile", str(tmp_path / "trace")]
    r = subprocess.run([sys.executable, "-m", "k26jax", *args], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert list((tmp_path / "trace").rglob("*.xplane.pb")), "no profiler trace written"
    assert any(p.name.startswith("jit_step") for p in cache.iterdir()), "the step was not cached on disk"


def test_method_needing_a_drafter_names_the_flag(tmp_path):
    target_only = tmp_path / "ckpt"
    shutil.copytree(DEFAULT_CKPT, target_only, ignore=shutil.ignore_patterns("drafter"))
    r = run_cli("generate", "--ckpt", str(target_only), "--prompt", "hi")
    assert r.returncode == 2 and "pass --drafter DIR, or use --method ar" in r.stderr, r.stderr


def test_out_of_device_memory_names_what_to_lower(monkeypatch, capsys):
    import jax

    from k26jax import cli, generation

    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 123 bytes")

    monkeypatch.setattr(generation, "generate", exhausted)
    assert cli.main(["generate", "--prompt", "hi", "--max-new-tokens", "9", "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert "error: out of device memory decoding a batch of 1 prompt(s)" in err and "lower --max-new-tokens" in err


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEFAULT_CKPT)


@pytest.mark.parametrize("text", ["Café 日本語", "naïve — “quotes” 🙂 ok", "ascii only"])
def test_streamed_text_equals_full_decode_of_multibyte_prompts(tok, text):
    ids = tok.encode(text)
    stream = StreamDecoder(tok)
    assert "".join(stream.feed([i]) for i in ids) + stream.flush() == tok.decode(ids) == text


def test_streamed_text_equals_full_decode_of_arbitrary_ids(tok):
    """Generated ids may split a character across tokens, or never finish it: each chunk holds back an incomplete
    sequence, and the whole equals the full decode (with U+FFFD where the bytes are not UTF-8)."""
    rng = np.random.default_rng(0)
    splitting = tok.encode("日本語🙂é")
    for _ in range(20):
        ids = rng.choice(np.concatenate([splitting, rng.integers(0, 700, 8)]), size=12).tolist()
        stream = StreamDecoder(tok)
        chunks = [stream.feed(ids[i : i + 3]) for i in range(0, len(ids), 3)]
        assert "".join(chunks) + stream.flush() == tok.decode(ids)
        assert all("\ufffd" not in c or "\ufffd" in tok.decode(ids) for c in chunks)


def test_a_value_error_from_inside_a_library_keeps_its_traceback(monkeypatch):
    import jax.numpy as jnp

    from k26jax import cli, generation

    def buggy(*args, **kwargs):
        jnp.concatenate([])  # a bug: jax raises the ValueError

    monkeypatch.setattr(generation, "generate", buggy)
    with pytest.raises(ValueError, match="at least one array"):
        cli.main(["generate", "--prompt", "hi", "--no-compile-cache"])


@pytest.mark.parametrize("where,ours", [("k26jax/generation.py", True), ("convert/__main__.py", True), (None, False)])
def test_user_errors_are_told_apart_by_the_file_that_raised_them_wherever_k26jax_is_installed(monkeypatch, where, ours):
    """An installed k26jax lives in site-packages, as jax does: what matters is whether the raising file is ours."""
    from k26jax import cli

    root = "/usr/lib/python3/site-packages"
    monkeypatch.setattr(cli, "OUR_CODE", (f"{root}/k26jax/", f"{root}/convert/"))
    path = os.path.join(root, where) if where else f"{root}/jax/_src/numpy.py"
    try:
        exec(compile("raise ValueError('x')", path, "exec"))
    except ValueError as e:
        assert cli._raised_by_k26jax(e) is ours


def test_one_string_is_one_prompt():
    import k26jax

    model = k26jax.load(DEFAULT_CKPT, dtype="float32")
    one = k26jax.generate(model, "Hello", max_new_tokens=3, method="ar")
    assert (
        len(one.tokens) == 1 and one.tokens == k26jax.generate(model, ["Hello"], max_new_tokens=3, method="ar").tokens
    )


def test_one_new_token_says_no_decode_step_ran():
    r = run_cli("generate", "--prompt", "hi", "--max-new-tokens", "1", "--method", "ar")
    assert r.returncode == 0, r.stderr
    assert "1 tokens in 0 steps, no decode step ran (the prefill gives the first token)" in r.stderr
    assert "tau=0.00" not in r.stderr
