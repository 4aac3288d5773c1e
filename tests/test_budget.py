"""Budget choice: E[tau] per budget from one build, the cost model and its fit, the choice, calibration."""

import itertools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k26jax import budget, ddtree, engine, ops, step_cost, synthetic
from k26jax.config import preset
from pallas_kernels import tree_build as tb

IMPLS = ops.Impls()
RESULTS = pathlib.Path(__file__).parent.parent / "bench" / "results"
RECORDS = ("e2e_h200_depth8_exact_widths.json", "e2e_h200_depth8_split_plans.json")


def logits_for(seed, C=5, L=7, V=64, tied=False):
    x = jax.random.normal(jax.random.key(seed), (C, L, V)) * 2
    return jnp.round(x) if tied else x  # rounding makes many exact ties


# ---- the budget-B tree is the first B nodes of a larger build -----------------------------------------------------
def build(logits, b):
    """What the engine's step at budget b builds: top-b per depth, then the best-first tree."""
    logq, ids = jax.jit(tb.draft_topk, static_argnums=1)(logits, b)
    C = logits.shape[0]
    return (logq, ids), tb.tree_build_reference(logq, ids, jnp.full((C,), b, jnp.int32), max_budget=b)


@pytest.mark.parametrize("tied", [False, True])
def test_budget_b_tree_is_a_prefix_of_the_largest_build(tied):
    logits = logits_for(1, tied=tied)
    C, b_max = logits.shape[0], 48
    (logq, ids), big = build(logits, b_max)
    for b in (5, 16, 33):
        (small_q, small_ids), small = build(logits, b)
        for got, want in zip(small, budget.prefix_tree(big, b)):
            np.testing.assert_array_equal(got, want)
        for c in range(C):  # the CPU heapq reference too, from the same top-K inputs
            tree = ddtree.build_tree_from_topk(np.asarray(small_q[c]), np.asarray(small_ids[c]), b)
            full = ddtree.build_tree_from_topk(np.asarray(logq[c]), np.asarray(ids[c]), b_max)
            np.testing.assert_array_equal(tree.tokens, full.tokens[:b])
            np.testing.assert_array_equal(tree.parents, full.parents[: b + 1])
            np.testing.assert_array_equal(tree.tokens, np.asarray(big[0][c, :b]))


def test_path_logq_is_the_sum_along_each_path():
    logits = logits_for(2, C=3)
    logq, ids = tb.draft_topk(logits, 48)
    tokens, depths, parents, num_nodes = tb.tree_build_reference(logq, ids, jnp.array([48, 25, 3]), max_budget=48)
    got = np.asarray(jax.jit(budget.path_logq)(tokens, depths, parents, logq, ids))
    for c in range(3):
        score = np.zeros(49)
        for i in range(1, int(num_nodes[c]) + 1):
            d = int(depths[c, i - 1])
            r = int(np.flatnonzero(np.asarray(ids[c, d - 1]) == int(tokens[c, i - 1]))[0])
            score[i] = score[int(parents[c, i])] + float(logq[c, d - 1, r])
        n = int(num_nodes[c])
        np.testing.assert_allclose(got[c, :n], score[1 : n + 1], rtol=1e-5)
        assert np.isneginf(got[c, n:]).all()
        assert (np.diff(got[c, :n]) <= 1e-5).all()  # pop order: non-increasing path probability


def test_expected_accept_is_exact_for_a_calibrated_drafter():
    """1 + sum of path probabilities == E[tau] by enumerating every target continuation (V = 4, L = 3)."""
    V, L = 4, 3
    logits = jax.random.normal(jax.random.key(3), (1, L, V)) * 1.5
    q = np.asarray(jax.nn.softmax(logits[0], -1), np.float64)
    logq, ids = tb.draft_topk(logits, V)
    tree = tb.tree_build_reference(logq, ids, jnp.array([12]), max_budget=12)
    curve = np.asarray(jax.jit(lambda *a: budget.expected_accept(budget.path_logq(*a)))(*tree[:3], logq, ids))[0]
    for b in (0, 1, 3, 6, 12):
        tokens, _, parents, _ = (np.asarray(x)[0] for x in budget.prefix_tree(tree, b))
        depth = np.zeros(b + 1, np.int64)
        for i in range(1, b + 1):
            depth[i] = depth[parents[i]] + 1
        exact = 0.0
        for seq in itertools.product(range(V), repeat=L):
            prob = np.prod([q[d, t] for d, t in enumerate(seq)])
            # the target's choice at a node of depth d is its token at depth d + 1 (none past L)
            post = np.array([seq[depth[i]] if depth[i] < L else -1 for i in range(b + 1)])
            path, _ = ddtree.follow_tree(tokens, parents, post)
            exact += prob * len(path)
        assert curve[b] == pytest.approx(exact, rel=1e-5), b


def test_candidate_taus_columns():
    logits = logits_for(4, C=4, V=300) * 2
    cands = (("ar", 0), ("chain", 7), ("ddtree", 8), ("ddtree", 16), ("ddtree", 48))
    out = jax.jit(lambda x: budget.candidate_taus(x, cands, impls=IMPLS))(logits)
    tau = np.asarray(out.tau)
    q = np.asarray(jax.nn.softmax(logits, -1))
    np.testing.assert_allclose(tau[:, 0], 1.0)
    np.testing.assert_allclose(tau[:, 1], 1 + np.cumprod(q.max(-1), axis=1).sum(1), rtol=1e-5)
    logq, ids = tb.draft_topk(logits, 48)
    t = out.tree
    curve = np.asarray(jax.jit(lambda *a: budget.expected_accept(budget.path_logq(*a)))(t[0], t[1], t[2], logq, ids))
    np.testing.assert_allclose(tau[:, 2:], curve[:, [8, 16, 48]], rtol=1e-5)
    assert (np.diff(tau[:, 2:], axis=1) > 0).all()
    assert (tau[:, 2] >= tau[:, 1] - 1e-6).all()  # 8 best-first nodes beat the 7-node chain


def test_candidate_taus_predict_the_synthetic_drafters_accept_length():
    """The in-step estimate, averaged over steps, equals what CalibratedAccept then measures (B = 16)."""
    profile = synthetic.fit_profile(5.3, 8, vocab=512)
    draft, accept = synthetic.synthetic_pair(profile, seed=2)
    sc = engine.StepConfig(method="ddtree", budget=16)
    cfg = preset("tiny").replace(vocab_size=512)

    @jax.jit
    def step(i):
        state = _State(i, jnp.zeros(256, jnp.int32))
        logits = draft.propose(None, None, state, cfg=cfg, dcfg=None, sc=sc)
        est = budget.candidate_taus(logits, (("ddtree", 16),), impls=IMPLS)
        tree = budget.prefix_tree(est.tree, 16)
        post = jnp.zeros((256, 17), jnp.int32)
        return est.tau[:, 0], accept.accept(tree[0], tree[2], post, tree[3], state, sc=sc, impls=IMPLS)[1]

    pred, seen = map(np.concatenate, zip(*[map(np.asarray, step(jnp.int32(i))) for i in range(2)]))
    assert abs(seen.mean() - pred.mean()) < 4 * seen.std() / np.sqrt(seen.size)


class _State:
    def __init__(self, step, root):
        self.step, self.root = step, root


# ---- the choice ------------------------------------------------------------------------------------------------
def test_choose_budget_maximises_tokens_per_second():
    tau = np.array([[5.0, 6.0, 7.0], [2.0, 2.5, 6.0]])
    cost = np.array([10.0, 12.0, 20.0])
    # rates: 7/10 = .70, 8.5/12 = .708, 13/20 = .65
    assert budget.choose_budget_host(tau, cost) == 1
    assert int(jax.jit(budget.choose_budget)(jnp.asarray(tau), jnp.asarray(cost))) == 1
    # only the first sequence active: 5/10 = .5 > 6/12 = .5? tie -> first; 7/20 = .35
    assert budget.choose_budget_host(tau, cost, [1, 0]) == 0
    assert int(budget.choose_budget(jnp.asarray(tau), jnp.asarray(cost), jnp.array([True, False]))) == 0
    rng = np.random.default_rng(0)
    for _ in range(20):
        t, c = rng.uniform(1, 8, (6, 5)), rng.uniform(5, 30, 5)
        want = int(np.argmax(t.sum(0) / c))
        assert budget.choose_budget_host(t, c) == want == int(budget.choose_budget(jnp.asarray(t), jnp.asarray(c)))


def test_per_sequence_choice_is_the_brute_force_optimum():
    rng = np.random.default_rng(1)
    for _ in range(5):
        tau = np.sort(rng.uniform(1, 8, (3, 4)), axis=1)
        cost, fixed = np.sort(rng.uniform(0.5, 4, 4)), 5.0
        best = max(
            itertools.product(range(4), repeat=3),
            key=lambda p: sum(tau[c, b] for c, b in enumerate(p)) / (fixed + sum(cost[b] for b in p)),
        )
        got = np.asarray(budget.choose_budget_per_sequence(jnp.asarray(tau), fixed, jnp.asarray(cost)))
        rate = lambda p: sum(tau[c, b] for c, b in enumerate(p)) / (fixed + sum(cost[b] for b in p))  # noqa: E731
        assert rate(tuple(got)) == pytest.approx(rate(best), rel=1e-5)


# ---- calibration -------------------------------------------------------------------------------------------------
def test_calibrate_power_and_isotonic_recover_a_known_map():
    rng = np.random.default_rng(2)
    s = rng.uniform(0.02, 1, 40000)
    y = (rng.uniform(size=s.size) < s**1.7).astype(float)
    power = budget.calibrate(s, y, "power")
    assert power.gamma == pytest.approx(1.7, abs=0.06)
    iso = budget.calibrate(s, y, "isotonic")
    grid = np.linspace(0.05, 0.95, 10)
    assert (np.diff(iso.ys) >= 0).all()
    np.testing.assert_allclose(np.asarray(iso(jnp.asarray(grid))), grid**1.7, atol=0.05)
    np.testing.assert_allclose(np.asarray(budget.Calibration()(jnp.asarray(grid))), grid)
    with pytest.raises(ValueError):
        budget.calibrate(s, y[:-1])


def test_calibration_fixes_an_overconfident_drafter():
    """A drafter sharpened to temperature 0.6 overpredicts tau; calibrated on observed accept lengths it doesn't."""
    profile = synthetic.fit_profile(4.0, 8, vocab=512)
    draft, accept = synthetic.synthetic_pair(profile, seed=5, temperature=0.6)
    sc = engine.StepConfig(method="ddtree", budget=16)
    cfg = preset("tiny").replace(vocab_size=512)

    @jax.jit
    def step(i):
        state = _State(i, jnp.zeros(256, jnp.int32))
        est = budget.candidate_taus(draft.propose(None, None, state, cfg=cfg, dcfg=None, sc=sc), (("ddtree", 16),),
                                    impls=IMPLS)  # fmt: skip
        tree = budget.prefix_tree(est.tree, 16)
        seen = accept.accept(tree[0], tree[2], jnp.zeros((256, 17), jnp.int32), tree[3], state, sc=sc, impls=IMPLS)
        return est.survival[:, 0], seen[1]

    fit_s, fit_len = map(np.concatenate, zip(*[map(np.asarray, step(jnp.int32(i))) for i in range(2)]))
    test_s, test_len = map(np.asarray, step(jnp.int32(10)))
    raw = 1 + test_s.sum(1)
    assert raw.mean() > test_len.mean() + 0.3  # overconfident
    for kind in ("power", "isotonic"):
        g = budget.calibrate(*budget.calibration_pairs(fit_s, fit_len), kind=kind)
        fixed = 1 + np.asarray(g(jnp.asarray(test_s))).sum(1)
        assert abs(fixed.mean() - test_len.mean()) < 4 * test_len.std() / np.sqrt(test_len.size), kind
    assert budget.calibrate(*budget.calibration_pairs(fit_s, fit_len)).gamma > 1


# ---- the cost model ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def records():
    return [json.loads((RESULTS / name).read_text()) for name in RECORDS]


def test_step_parts_match_the_records_byte_accounting(records):
    cfg, dcfg = step_cost._config(8)
    checked = 0
    for rec in records:
        for r in rec["rows"]:
            if r.get("kind") == "step" and "bytes_by_part" in r:
                parts = step_cost.step_parts(cfg, dcfg, r["method"], r["B"], r["C"], r["context"])
                assert set(parts) == set(r["bytes_by_part"])
                for name, want in r["bytes_by_part"].items():
                    assert parts[name][0] == pytest.approx(want, rel=1e-9), (r["variant"], name)
                checked += 1
    assert checked >= 10


def test_experts_touched():
    E, k = 384, 8
    total, worst = step_cost.experts_touched(33, E, k)
    assert total == pytest.approx(E * (1 - (1 - k / E) ** 33), rel=1e-6) and worst == total
    assert step_cost.experts_touched(1, E, k, skew=1.5)[0] == pytest.approx(k, rel=1e-3)  # one token: k experts
    assert step_cost.experts_touched(64, E, k, skew=1.0)[0] < total * 2
    assert step_cost.experts_touched(64, E, k, skew=1.0)[0] < step_cost.experts_touched(64, E, k)[0]
    rng = np.random.default_rng(0)  # the busiest of 8 EP shards against sampled balanced routing
    picks = np.argsort(rng.random((400, 33, E)), axis=2)[:, :, :k]
    hit = np.zeros((400, E), bool)
    np.put_along_axis(hit, picks.reshape(400, -1), True, axis=1)
    sampled = hit.reshape(400, 8, -1).sum(2).max(1).mean()
    assert step_cost.experts_touched(33, E, k, shards=8)[1] == pytest.approx(sampled, rel=0.03)


def _synthetic_rows(truth: step_cost.StepCost, noise: float, rng):
    rows = []
    machine = step_cost.Machine(4.2, 810.0)
    builds = [dict(kind="build", method="ddtree", B=32, C=c, build_ms=step_cost.build_ms("ddtree", 32, c, 163840))
              for c in (1, 8)]  # fmt: skip
    for method, B, C, ctx in itertools.product(("ar", "chain", "ddtree"), (16, 64), (1, 8), (1024, 8192, 32768)):
        if method != "ddtree" and B != 16:
            continue
        for skip in ((), ("moe",), ("attention",)):
            row = dict(layers=8, method=method, B=B, C=C, context=ctx, skip=skip, machine=machine, builds=builds)
            row["step_ms"] = step_cost.predict(truth, row) * (1 + noise * rng.standard_normal())
            rows.append(row)
    return rows


def test_fit_recovers_a_known_model_and_holds_out_within_ten_percent():
    coef = dict(step_cost.PRIOR, fixed=0.6, attn_layers=0.06, moe=1.4, kv=2.5, attn_flops=1.9, drafter=1.1)
    truth = step_cost.StepCost(tuple(coef.items()), step_cost.BUILD_PRIOR, skew=0.0)
    rows = _synthetic_rows(truth, 0.0, np.random.default_rng(0))
    fitted = step_cost.fit(rows, ridge=1e-6, skews=(0.0,))
    for r in rows:
        assert step_cost.predict(fitted, r) == pytest.approx(r["step_ms"], rel=1e-3)
    noisy = _synthetic_rows(truth, 0.03, np.random.default_rng(1))
    errors = [h["rel_err"] for h in step_cost.holdout(noisy, ridge=0.01, skews=(0.0,))]
    assert len(errors) == len(noisy) and max(abs(e) for e in errors) < 0.10


def test_fit_on_the_committed_records_and_the_projection(records):
    rows = step_cost.record_rows(records)
    assert len(rows) == 13 and all(r["skip"] or r["method"] in ("ar", "ddtree") for r in rows)
    cost = step_cost.fit(rows)
    for r in rows:
        assert abs(step_cost.predict(cost, r) / r["step_ms"] - 1) < 0.25
    cfg61 = preset("k26")
    dcfg = step_cost.kimi_drafter_config(cfg61)
    one = step_cost.StepCost(cost.coef, cost.build)  # balanced routing for the projection
    eight = step_cost.Machine(4.2, 810.0, gpus=8)
    t1 = one.terms(cfg61, dcfg, "ddtree", 32, 8, 8192, step_cost.Machine(4.2, 810.0))
    t8 = one.terms(cfg61, dcfg, "ddtree", 32, 8, 8192, eight)
    assert t1["collectives"] == 0 < t8["collectives"]
    assert t8["moe"] < t1["moe"] / 4 and t8["weights"] < t1["weights"] / 4
    table = one.table(cfg61, dcfg, budget.CANDIDATES, 8, 8192, eight)
    assert table.shape == (6,) and (np.diff(table[1:]) > 0).all()
