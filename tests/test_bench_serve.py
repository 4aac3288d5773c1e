"""scripts/bench_serve.py's workload (--prompts heldout reads the served checkpoint's tokenizer) and its bare loops."""

import os

import pytest

from k26jax.api import DEFAULT_CKPT
from k26jax.tokenizer import Tokenizer
from k26jax.train import corpus

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "tiny")


def test_heldout_prompts_are_the_served_tokenizers_heldout_file_starts(import_script):
    bench = import_script("bench_serve")
    args = bench.parse_args(["--launch", "--prompts", "heldout", "--prompt-len", "64", "--", "--ckpt", DEFAULT_CKPT])
    prompts = bench.load_prompts(args, 1 << 30)
    want, files = corpus.heldout_prompts(Tokenizer(DEFAULT_CKPT), n=64, prompt_tokens=64)
    assert prompts == want.tolist() and len(prompts) >= 8 and {len(p) for p in prompts} == {64}
    assert all(corpus.is_heldout(f) for f in files)
    with pytest.raises(SystemExit, match="needs --launch"):
        bench.load_prompts(bench.parse_args(["--url", "http://127.0.0.1:1", "--prompts", "heldout"]), 1 << 30)


def test_bare_loop_times_steps_alone_and_the_servers_workload(import_script):
    """--bare: the steps-only loop, and the same workload as the server's (requests of --max-tokens, a finished
    slot refilled by an insert at once) without the server."""
    bench = import_script("bench_serve")
    args = bench.parse_args(
        ["--launch", "--bare", "--concurrency", "2", "--prompt-len", "16", "--max-tokens", "6", "--bare-steps", "4"]
        + ["--", "--ckpt", TINY, "--dtype", "float32", "--max-len", "128", "--max-batch", "2", "--method", "ar"]
    )
    row = bench.bare_loop(args)["rows"][2]
    assert row["steps"] == 4 and row["tokens"] == 8 and row["tok_s"] > 0  # AR: one token a slot a step
    # 16 workload steps of 2 slots, 6 tokens a request (the insert emits the first): a slot is refilled every
    # 5 steps at the latest (3 inserts a slot), sooner where the random model emits an end-of-text id
    assert row["workload_steps"] == 16 and 6 <= row["workload_inserts"] <= 32 and row["workload_tok_s"] > 0
