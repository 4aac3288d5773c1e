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


@pytest.mark.parametrize("C,batches", [(1, 8), (4, 2), (8, 1)])
def test_speed_decodes_several_prompts_in_batches_of_c_and_sums_their_seconds(import_script, monkeypatch, C, batches):
    """--speed: a decode is the first max(C, --speed-prompts) prompts in batches of C (one prompt's tau at C = 1 is
    noise), its tokens a second summed over the batches; an auto row keeps the policy's stats."""
    bench = import_script("bench_acceptance")
    sizes = []

    def generate(model, rows, **kw):
        sizes.append(len(rows))
        stats = dict(decode_s=0.5, prefill_s=0.1, compile_s=0.0, steps=2, new_tokens=3 * len(rows), tokens_per_s=1.0)
        stats.update(accept_lens=np.full((2, len(rows)), 2), auto={"choices": {"chain": 2}})
        return types.SimpleNamespace(tokens=[[1, 2, 3]] * len(rows), stats=stats)

    monkeypatch.setattr(bench.k26jax, "generate", generate)
    model = types.SimpleNamespace(drafter_cfg=types.SimpleNamespace(block_size=8))
    args = bench.parse_args(["--speed", "--speed-prompts", "8", "--repeats", "2"])
    row = bench.speed_row(model, np.zeros((12, 4), np.int32), C, "ddtree", "auto", args, [])
    assert sizes == [C] * batches * 3  # a warm-up decode and two timed ones
    assert row["prompts"] == 8 and row["steps"] == 2 * batches and row["tau"] == 2.0
    assert row["tokens_per_s"] == pytest.approx(3 * 8 / (0.5 * batches))
    assert row["auto"] == {"choices": {"chain": 2}}
