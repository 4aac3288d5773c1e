"""The calibrated synthetic drafter: its law, its expected accept lengths, and the real engine step with it."""

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k26jax import engine, ops, synthetic
from k26jax.config import preset
from k26jax.model import target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IMPLS = ops.Impls()
V = 1024  # the tiny preset's vocabulary
L = 7


class FakeState(NamedTuple):
    """The two DecodeState fields the synthetic pair reads."""

    step: jax.Array
    root: jax.Array


@pytest.fixture(scope="module")
def profile():
    return synthetic.fit_profile(5.3, 8, vocab=V)


@pytest.fixture(scope="module")
def curve(profile):
    return synthetic.tau_curve(profile, (8, 16, 32, 128))


def test_fit_profile_hits_the_chain_target_at_both_vocabularies():
    for vocab in (V, 163840):
        p = synthetic.fit_profile(5.3, 8, vocab=vocab)
        assert synthetic.expected_tau(p, "chain") == pytest.approx(5.3, abs=1e-3)
    p4 = synthetic.fit_profile(3.0, 8, vocab=V, spread=0.0)
    assert synthetic.expected_tau(p4, "chain") == pytest.approx(3.0, abs=1e-3)
    assert p4.level < synthetic.fit_profile(5.3, 8, vocab=V, spread=0.0).level


def test_tau_rises_with_budget_and_ar_is_one(profile, curve):
    assert synthetic.expected_tau(profile, "ar") == 1.0
    taus = [curve["chain"]] + [curve[b] for b in (8, 16, 32, 128)]
    assert np.all(np.diff(taus) > 0), taus
    assert taus[-1] < 8
    # the budget-7 tree is the optimal 7-node tree: at least the chain
    assert synthetic.expected_tau(profile, "ddtree", 7) >= curve["chain"] - 1e-9


def test_fit_profile_with_a_tree_point_fits_the_tail():
    truth = synthetic.fit_profile(5.3, 8, vocab=V, tail=2.2)
    point = synthetic.tau_curve(truth, (32,))[32]
    fitted = synthetic.fit_profile(5.3, 8, vocab=V, tree_tau={32: point})
    assert fitted.tail == pytest.approx(2.2, abs=0.05)


def test_drafter_law_and_target_draws_agree(profile):
    C = 4096

    @jax.jit
    def law(step):
        p, offset, rank = synthetic.draws(profile, 3, step, C, L)
        return p, offset, rank, synthetic.draft_logits(profile, p[:8], offset[:8])

    p, offset, rank, logits = law(jnp.int32(5))
    np.testing.assert_allclose(jax.nn.logsumexp(logits, -1), 0.0, atol=1e-4)  # normalised log q
    top = jnp.argmax(logits, -1)
    np.testing.assert_array_equal(top, jnp.where(p[:8] >= 0.5, offset[:8], top))  # rank 0 is token offset
    np.testing.assert_allclose(jnp.exp(jnp.max(logits, -1))[p[:8] >= 0.5], p[:8][p[:8] >= 0.5], rtol=1e-5)
    # P(target rank 0) = E[p]; given a miss, P(rank 1) = the Zipf weight of rank 1
    hit = np.asarray(rank == 0, np.float64)
    pm = np.asarray(p, np.float64)
    assert abs(hit.mean() - pm.mean()) < 4 * np.sqrt(pm.mean() * (1 - pm.mean()) / hit.size)
    miss = np.asarray(rank)[np.asarray(rank) > 0]
    w1 = synthetic._tail_weights(V, profile.tail)[0]
    assert abs((miss == 1).mean() - w1) < 4 * np.sqrt(w1 * (1 - w1) / miss.size)
    assert miss.max() < V
    # same key, same draws: the acceptor sees what the drafter proposed
    np.testing.assert_array_equal(law(jnp.int32(5))[2], rank)
    assert (np.asarray(law(jnp.int32(6))[2]) != np.asarray(rank)).any()


def test_base_drafter_stays_live_and_vocab_is_checked(profile):
    cfg = preset("tiny")
    state = FakeState(jnp.int32(2), jnp.zeros(3, jnp.int32))
    sc = engine.StepConfig(method="ddtree", budget=8)
    params = {"lm_head": jnp.zeros((1, V))}
    propose = lambda d: jax.jit(lambda s: d.propose(params, None, s, cfg=cfg, dcfg=None, sc=sc))(state)  # noqa: E731
    plain = propose(synthetic.SyntheticDraft(profile, 1))
    np.testing.assert_array_equal(propose(synthetic.SyntheticDraft(profile, 1, base=engine.RandomDraft(0))), plain)
    other = synthetic.SyntheticDraft(synthetic.Profile(vocab=V + 1))
    with pytest.raises(ValueError, match="vocab"):
        other.propose(params, None, state, cfg=cfg, dcfg=None, sc=sc)


@functools.partial(jax.jit, static_argnames=("sc", "C", "profile", "temperature"))
def simulate(step, *, sc, C, profile, temperature=1.0):
    """One model-free step: synthetic proposal -> the engine's tree -> CalibratedAccept (real tree_accept)."""
    draft, accept = synthetic.synthetic_pair(profile, seed=7, temperature=temperature)
    state = FakeState(step, jnp.zeros(C, jnp.int32))
    cfg = preset("tiny")
    logits = draft.propose(None, None, state, cfg=cfg, dcfg=None, sc=sc)
    (tokens, depths, parents, num_nodes), _, _ = engine.build_tree(logits, sc=sc, impls=IMPLS)
    post = jnp.full(parents.shape, -5, jnp.int32)  # the "real target" never matches: depth-L nodes end the walk
    path, accept_len, bonus = accept.accept(tokens, parents, post, num_nodes, state, sc=sc, impls=IMPLS)
    return logits, (tokens, depths, parents, num_nodes), (path, accept_len, bonus), accept.target_tokens(state, C, L)


SIM = dict(sc=engine.StepConfig(method="ddtree", budget=32), C=512)


def test_model_free_tau_matches_expected(profile, curve):
    lens = np.concatenate([np.asarray(simulate(jnp.int32(s), profile=profile, **SIM)[2][1]) for s in range(3)])
    assert abs(lens.mean() - curve[32]) < 4 * lens.std() / np.sqrt(lens.size), (lens.mean(), curve[32])


def test_accepted_path_is_a_valid_maximal_tree_path(profile):
    _, tree, (path, accept_len, bonus), true = simulate(jnp.int32(11), profile=profile, **SIM)
    tokens, depths, parents, num_nodes = map(np.asarray, tree)
    path, accept_len, bonus, true = map(np.asarray, (path, accept_len, bonus, true))
    assert accept_len.min() >= 1 and accept_len.max() == L + 1 and accept_len.min() < 3
    for c in range(64):
        a = accept_len[c]
        assert path[c, 0] == 0 and (path[c, a:] == -1).all() and (path[c, :a] >= 0).all()
        for j in range(1, a):
            node = path[c, j]
            assert 1 <= node <= num_nodes[c]
            assert parents[c, node] == path[c, j - 1]
            assert depths[c, node - 1] == j
            assert tokens[c, node - 1] == true[c, j - 1]
        if a <= L:  # stopped: no child of the last node carries the target's next token, which is the bonus
            last = path[c, a - 1]
            children = [i for i in range(1, num_nodes[c] + 1) if parents[c, i] == last]
            assert all(tokens[c, i - 1] != true[c, a - 1] for i in children)
            assert bonus[c] == true[c, a - 1]
        else:
            assert bonus[c] == -5  # the real target's choice at a depth-L node


# ---- through the engine's compiled step on the tiny model ---------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    """Tiny target (2 layers) with zero weights (fast to make; acceptance comes from the synthetic pair)."""
    cfg = preset("tiny").replace(num_hidden_layers=2)
    params = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), target.abstract_params(cfg, jnp.float32))
    return cfg, params


def run_engine(tiny, profile, method, budget, C, steps):
    cfg, params = tiny
    draft, accept = synthetic.synthetic_pair(profile, seed=1)
    sc = engine.StepConfig(method=method, budget=budget, max_new_tokens=steps * 8 + 8, block_size=L + 1)
    dec = engine.Decoder(cfg, None, sc, IMPLS, drafter=draft, acceptor=accept)
    ids = jnp.tile(jnp.arange(5, 13, dtype=jnp.int32)[None], (C, 1))
    state = dec.prefill(params, None, ids, jnp.full((C,), 8, jnp.int32), jax.random.key(0), max_len=16 + steps * 8)
    state = dec.run(params, None, state, steps)
    return np.asarray(state.accept_lens)[:steps], state


def test_engine_chain_tau_is_the_target(tiny, profile):
    lens, state = run_engine(tiny, profile, "chain", 7, C=32, steps=12)
    assert abs(lens.mean() - 5.3) < 4 * lens.std() / np.sqrt(lens.size), lens.mean()
    assert (np.asarray(state.num_out) == 1 + lens.sum(0)).all()  # every accepted token was emitted


def test_engine_ddtree_tau(tiny, profile, curve):
    lens, _ = run_engine(tiny, profile, "ddtree", 16, C=8, steps=12)
    assert abs(lens.mean() - curve[16]) < 4 * lens.std() / np.sqrt(lens.size), (lens.mean(), curve[16])


def test_bench_acceptance_fits_the_synthetic_drafter_to_the_mini_pairs_curve(import_script, tmp_path):
    """scripts/bench_acceptance.py --fit-synthetic on the committed record: both profiles reproduce the chain's
    measured tau, and fitting the tail to the tree curve brings the predicted curve closer to the measured one."""
    import json
    import shutil

    bench = import_script("bench_acceptance")
    out = tmp_path / "acc.json"
    shutil.copy(os.path.join(ROOT, "bench", "results", "acceptance_mini.json"), out)
    bench.main(["--fit-synthetic", "--out", str(out)])
    fit = json.loads(out.read_text())["synthetic"]
    measured = {k: v for k, v in fit["measured"].items() if k != "chain"}

    def error(name):
        return sum((fit[name]["predicted"][b] - t) ** 2 for b, t in measured.items())

    for name in ("chain_only", "chain_and_tree"):
        assert fit[name]["predicted"]["chain"] == pytest.approx(fit["measured"]["chain"], abs=1e-3)
        assert fit[name]["k26_chain_5.3"]["chain"] == pytest.approx(5.3, abs=1e-3)
    assert error("chain_and_tree") < error("chain_only") and len(measured) >= 4
