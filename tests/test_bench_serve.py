"""scripts/bench_serve.py's workload: --prompts heldout reads the served checkpoint's tokenizer."""

import pytest

from k26jax.generation import DEFAULT_CKPT
from k26jax.tokenizer import Tokenizer
from k26jax.train import corpus


def test_heldout_prompts_are_the_served_tokenizers_heldout_file_starts(import_script):
    bench = import_script("bench_serve")
    args = bench.parse_args(["--launch", "--prompts", "heldout", "--prompt-len", "64", "--", "--ckpt", DEFAULT_CKPT])
    prompts = bench.load_prompts(args, 1 << 30)
    want, files = corpus.heldout_prompts(Tokenizer(DEFAULT_CKPT), n=64, prompt_tokens=64)
    assert prompts == want.tolist() and len(prompts) >= 8 and {len(p) for p in prompts} == {64}
    assert all(corpus.is_heldout(f) for f in files)
    with pytest.raises(SystemExit, match="needs --launch"):
        bench.load_prompts(bench.parse_args(["--url", "http://127.0.0.1:1", "--prompts", "heldout"]), 1 << 30)
