"""scripts/bench_acceptance.py --prompts-from RUN: a train_mini run's held-out prompts stand in for this
interpreter's stdlib (the GPU machine's Python has another), and are the same prompts where the stdlib matches."""

import json
import os
import shutil
import types

import numpy as np
import pytest

from k26jax.api import DEFAULT_CKPT
from k26jax.tokenizer import Tokenizer
from k26jax.train import corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model():
    return types.SimpleNamespace(path=DEFAULT_CKPT, tokenizer=Tokenizer(DEFAULT_CKPT))


def make_run(tmp_path, model, tokenizer_dir=DEFAULT_CKPT):
    """What the tokenizer stage writes that --prompts-from reads: held-out prompts, their manifest, the tokenizer."""
    run = tmp_path / "run"
    (run / "tokens").mkdir(parents=True)
    (run / "tokenizer").mkdir()
    files = corpus.corpus_files(None, False)
    prompts, names = corpus.heldout_prompts(model.tokenizer, n=64, files=files)
    np.save(run / "tokens" / "heldout_prompts.npy", prompts)
    manifest = corpus.corpus_manifest(corpus.stdlib_root(), files) | {"heldout_prompt_files": names}
    (run / "tokens" / "data_manifest.json").write_text(json.dumps(manifest))
    shutil.copy(os.path.join(tokenizer_dir, "tiktoken.model"), run / "tokenizer")
    return run


def test_a_runs_prompts_equal_this_stdlibs(import_script, tmp_path, model):
    bench = import_script("bench_acceptance")
    run = make_run(tmp_path, model)
    want, want_info = bench.load_prompts(model, bench.parse_args(["--prompts", "5"]))
    got, info = bench.load_prompts(model, bench.parse_args(["--prompts", "5", "--prompts-from", str(run)]))
    assert got.shape == (5, 256) and np.array_equal(got, want)
    assert info == want_info
    stored = np.load(run / "tokens" / "heldout_prompts.npy")
    np.save(run / "tokens" / "heldout_prompts.npy", stored[::-1])  # the run's file decides, not this stdlib
    got, _ = bench.load_prompts(model, bench.parse_args(["--prompts", "5", "--prompts-from", str(run)]))
    assert np.array_equal(got, stored[::-1][:5])


def test_prompts_from_names_a_missing_file_and_a_foreign_tokenizer(import_script, tmp_path, model):
    bench = import_script("bench_acceptance")
    run = make_run(tmp_path, model, tokenizer_dir=os.path.join(ROOT, "checkpoints", "tiny"))
    with pytest.raises(SystemExit, match="is not .*'s tokenizer"):
        bench.load_prompts(model, bench.parse_args(["--prompts-from", str(run)]))
    os.remove(run / "tokens" / "heldout_prompts.npy")
    with pytest.raises(SystemExit, match="heldout_prompts.npy is missing"):
        bench.load_prompts(model, bench.parse_args(["--prompts-from", str(run)]))
