"""The embedded k26-mini pair (issue 29) on 8 committed held-out prompts: lossless greedy and real acceptance.

The checkpoint is checkpoints/mini (the default of the CLI and the API), or the directory in $K26_MINI_CKPT (e.g. a
`scripts/train_mini.py --smoke` run's hf/ stage, to check this file's plumbing: its barely trained drafter fails
the tau thresholds by design).
The prompts (tests/fixtures/mini_heldout_prompts.json) are the first 128 token ids of the first 8 held-out
prompts, under the tokenizer that the full train_mini recipe trains (deterministic; its sha256 is in the file).
Another checkpoint's tokenizer gets the same texts re-encoded (only through $K26_MINI_CKPT).

Regenerate the fixture:  python tests/test_mini_pair.py RUN_DIR/tokenizer   (after train_mini --stages tokenizer)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MINI = os.path.join(ROOT, "checkpoints", "mini")
MINI = os.environ.get("K26_MINI_CKPT") or DEFAULT_MINI
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "mini_heldout_prompts.json")
NUM_PROMPTS, PROMPT_TOKENS = 8, 128
NEW = 64
BUDGET = 32
TAU_MIN = 3.0
MIN_DISTINCT4 = 0.5  # distinct 4-grams / 4-grams of a continuation; below it the continuation loops

needs_mini = pytest.mark.skipif(
    not os.path.isdir(MINI),
    reason="checkpoints/mini is not trained yet (issue 29)"
    if MINI == DEFAULT_MINI
    else f"K26_MINI_CKPT={MINI} does not exist",
)


def distinct4(tokens) -> float:
    grams = [tuple(tokens[i : i + 4]) for i in range(len(tokens) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def read_fixture() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)


def test_fixture_holds_heldout_prompts():
    from k26jax.train import corpus

    fx = read_fixture()
    assert len(fx["prompts"]) == NUM_PROMPTS
    for p in fx["prompts"]:
        assert corpus.is_heldout(p["file"]), p["file"]
        assert len(p["ids"]) == PROMPT_TOKENS and p["text"], p["file"]


# ---- the checkpoint ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    import jax.numpy as jnp

    import k26jax

    m = k26jax.load(MINI)
    assert m.dtype == jnp.bfloat16 and m.drafter_cfg is not None
    return m


@pytest.fixture(scope="module")
def prompts(model):
    """The committed ids when the checkpoint's tokenizer is the one they were made with, else (K26_MINI_CKPT only)
    the committed texts re-encoded, cut to PROMPT_TOKENS."""
    fx = read_fixture()
    if sha256_file(os.path.join(MINI, "tiktoken.model")) == fx["tokenizer_sha256"]:
        return [p["ids"] for p in fx["prompts"]]
    if MINI == DEFAULT_MINI:
        pytest.fail(f"{MINI}'s tokenizer is not the one {FIXTURE} was made with: regenerate it (see this docstring)")
    enc = model.tokenizer.encoding
    return [enc.encode_ordinary(p["text"])[:PROMPT_TOKENS] for p in fx["prompts"]]


def decode(model, prompts, method):
    import k26jax

    return k26jax.generate(model, prompts, max_new_tokens=NEW, method=method, budget=BUDGET, temperature=0.0)


@pytest.fixture(scope="module")
def model32():
    import k26jax

    return k26jax.load(MINI, dtype="float32")


@pytest.fixture(scope="module")
def ar(model, model32, prompts):
    """bf16 AR greedy tokens; per prompt the float32 top-1 minus top-2 logit margin at each of its tokens; and
    `noise`: the most that bf16 moved such a gap (bf16 against float32 forward, over every token of every prompt)."""
    tokens = decode(model, prompts, "ar").tokens
    margins, noise = [], 0.0
    for p, t in zip(prompts, tokens):
        seq = np.array([p + t])
        l32 = np.asarray(model32.logits(seq))[0, len(p) - 1 : -1]
        l16 = np.asarray(model.logits(seq))[0, len(p) - 1 : -1]
        top2 = np.argsort(l32, -1)[:, -2:]

        def gap(x):
            return np.take_along_axis(x, top2[:, 1:], -1)[:, 0] - np.take_along_axis(x, top2[:, :1], -1)[:, 0]

        margins.append(gap(l32))
        noise = max(noise, float(np.abs(gap(l16) - gap(l32)).max()))
    return tokens, margins, noise


@pytest.fixture(scope="module")
def chain(model, prompts):
    return decode(model, prompts, "chain")


@pytest.fixture(scope="module")
def ddtree(model, prompts):
    return decode(model, prompts, "ddtree")


# ---- the tests -----------------------------------------------------------------------------------------------
@needs_mini
@pytest.mark.parametrize("method", ["chain", "ddtree"])
def test_float32_greedy_emits_ar_tokens(method, model32, prompts):
    """In float32, greedy chain and DDTree (B = 32) emit exactly AR's tokens on every prompt: no exception."""
    want = decode(model32, prompts, "ar").tokens
    got = decode(model32, prompts, method).tokens
    bad = [i for i, (a, g) in enumerate(zip(want, got)) if a != g]
    assert not bad, f"{method} != AR in float32 on prompts {bad}"


@needs_mini
@pytest.mark.parametrize("method", ["chain", "ddtree"])
def test_bf16_greedy_emits_ar_tokens(method, request, ar):
    """In bf16, greedy chain and DDTree emit AR's tokens, except after a documented near-tie: a first difference
    where the float32 margin between the top two tokens is below `noise`, the most that bf16 rounding was measured
    to move such a gap on these prompts (a verify pass and an AR step round differently, and each path's cache
    holds its own bf16 rows). Each exception is named in a warning; float32 (the test above) admits none."""
    ar_tokens, margins, noise = ar
    got = request.getfixturevalue(method).tokens
    mismatches, ties, compared = [], [], 0
    for i, (a, g) in enumerate(zip(ar_tokens, got)):
        d = next((k for k, (x, y) in enumerate(zip(a, g)) if x != y), None)
        if d is None and len(a) != len(g):  # one stopped at [EOS] early
            mismatches.append(f"prompt {i}: {len(g)} tokens against AR's {len(a)}")
        elif d is None:
            compared += len(a)
        elif margins[i][d] < noise:
            ties.append(f"prompt {i}: token {d} (float32 margin {margins[i][d]:.3f} < bf16 noise {noise:.3f})")
            compared += d
        else:
            mismatches.append(f"prompt {i}: token {d}, float32 margin {margins[i][d]:.3f} >= bf16 noise {noise:.3f}")
    if ties:
        warnings.warn(f"{method} parts from AR in bf16 at near-ties: {'; '.join(ties)}", stacklevel=1)
    assert not mismatches, f"{method} greedy != AR in bf16: {'; '.join(mismatches)}"
    total = sum(map(len, ar_tokens))
    assert 2 * compared >= total, f"near-ties cut the comparison to {compared} of {total} tokens: too flat to test"


# The embedded pair misses one of issue 29's thresholds; the xfail is strict, so it fails once a better pair passes.
MISSED_LOOPS = pytest.mark.xfail(
    strict=True,
    reason="issue 29, open: 3 of the embedded pair's 8 greedy continuations loop (distinct-4-gram ratio 0.05, 0.13, "
    "0.31); a small target trained on 2.8M tokens repeats itself at temperature 0",
)


@needs_mini
def test_ddtree_tau_at_least_3(ddtree):
    assert ddtree.stats["tau"] >= TAU_MIN, f"tau(DDTree, B={BUDGET}) = {ddtree.stats['tau']:.3f} < {TAU_MIN}"


@needs_mini
def test_ddtree_tau_above_chain(ddtree, chain):
    t_tree, t_chain = ddtree.stats["tau"], chain.stats["tau"]
    assert t_tree > t_chain, f"tau(DDTree, B={BUDGET}) = {t_tree:.3f} <= tau(chain) = {t_chain:.3f}"


@needs_mini
@MISSED_LOOPS
def test_continuations_do_not_loop(ddtree):
    ratios = [round(distinct4(t), 3) for t in ddtree.tokens]
    looping = [(i, r) for i, r in enumerate(ratios) if r < MIN_DISTINCT4]
    assert not looping, f"continuations with a distinct-4-gram ratio < {MIN_DISTINCT4} (prompt, ratio): {looping}"


# ---- the fixture's maker -------------------------------------------------------------------------------------
def write_fixture(tokenizer_dir: str) -> None:
    """The first NUM_PROMPTS held-out prompts of the bench (each file's first 256 ids), cut to PROMPT_TOKENS."""
    import platform

    from k26jax.tokenizer import Tokenizer
    from k26jax.train import corpus

    tok = Tokenizer(tokenizer_dir)
    files = corpus.corpus_files(None, False)
    ids, names = corpus.heldout_prompts(tok, n=NUM_PROMPTS, prompt_tokens=256, files=files)
    rows = []
    for f, row in zip(names, ids[:, :PROMPT_TOKENS].tolist()):
        text = tok.decode(row)
        assert tok.encoding.encode_ordinary(text) == row, f"{f}: the prefix's text does not re-encode to its ids"
        rows.append({"file": f, "ids": row, "text": text})
    fx = {
        "about": "first 128 ids of the first 8 held-out k26-mini prompts (k26jax.train.corpus.heldout_prompts, 256)",
        "made_by": "python tests/test_mini_pair.py RUN_DIR/tokenizer (scripts/train_mini.py --stages tokenizer)",
        "tokenizer_sha256": sha256_file(os.path.join(tokenizer_dir, "tiktoken.model")),
        "python_version": platform.python_version(),
        "corpus_file_list_sha256": corpus.file_list_hash(files),
        "prompts": rows,
    }
    head = json.dumps({k: v for k, v in fx.items() if k != "prompts"}, indent=1)[:-2]
    with open(FIXTURE, "w") as f:
        f.write(head + ',\n "prompts": [\n' + ",\n".join("  " + json.dumps(r) for r in rows) + "\n ]\n}\n")
    print(f"wrote {FIXTURE}: {[r['file'] for r in rows]}")


if __name__ == "__main__":
    write_fixture(sys.argv[1])
