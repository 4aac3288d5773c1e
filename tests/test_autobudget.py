"""budget="auto" (k26jax.autobudget): the host policy on hand-made inputs, the step's survival against
k26jax.budget's estimate of the same draft, and generate's auto decoding against AR (lossless)."""

import dataclasses
import os
import time

import jax
import numpy as np
import pytest

import k26jax
from k26jax import autobudget, budget, engine
from k26jax.generation import generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "checkpoints", "tiny")  # random weights: the mechanism, not the trained pair

CANDS = (("chain", 7), ("ddtree", 8), ("ddtree", 32))


def _survival(rng, C=3, n=len(CANDS), L=7):
    """A valid survival [C, nB, L]: non-increasing in depth."""
    return np.sort(rng.random((C, n, L)), axis=-1)[..., ::-1].copy()


def _observe(pol, i, seconds, C=1):
    zero = np.zeros((C, len(CANDS), 7))
    pol.observe(i, seconds, zero, np.ones(C, int), np.zeros(C, bool))


def test_every_candidate_is_tried_a_switch_step_then_two_timed_before_any_choice():
    rng = np.random.default_rng(0)
    pol = autobudget.Policy(CANDS, explore_every=0)
    seen = []
    for _ in range(3 * len(CANDS)):
        i = pol.choose(_survival(rng), np.ones(3))
        seen.append(i)
        pol.observe(i, 0.01 * (i + 1), _survival(rng), np.ones(3, int), np.zeros(3, bool))
    assert seen == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert pol.timed == [2, 2, 2] and pol.seconds == pytest.approx([0.01, 0.02, 0.03])


def test_the_choice_maximises_expected_tokens_per_second_over_active_slots():
    rng = np.random.default_rng(1)
    pol = autobudget.Policy(CANDS, explore_every=0, refit_every=0)
    times = [0.010, 0.012, 0.030]
    for i, t in enumerate(times):
        for _ in range(3):
            _observe(pol, i, t)
    assert pol.switch_s == 0.0
    for _ in range(20):
        s, active = _survival(rng), rng.random(3) < 0.7
        tau = 1 + s.sum(-1)
        want = int(np.argmax((tau * active[:, None]).sum(0) / np.asarray(times)))
        assert pol.choose(s, active) == want
    # a slower step can win when its expected accept length grows enough
    s = np.zeros((1, 3, 7))
    s[0, 2] = 1.0
    assert pol.choose(s, np.ones(1)) == 2


def test_only_steps_after_the_same_candidate_are_timed_and_the_stalest_is_retried():
    pol = autobudget.Policy(CANDS, explore_every=12, refit_every=0)
    for t in (5.0, 9.0, 1.0, 2.0):  # a switch step (untimed), a first timed step (replaced), then the average
        _observe(pol, 0, t)
    assert pol.timed[0] == 3 and pol.seconds[0] == pytest.approx((1 - autobudget.EMA) * 1.0 + autobudget.EMA * 2.0)
    for i in (1, 1, 1, 2, 2, 2):
        _observe(pol, i, 1.0)
    _observe(pol, 0, 1.5 + pol.seconds[0])  # a switch back costs 1.5 s more than candidate 0's own step
    assert pol.switch_s == pytest.approx(autobudget.EMA * 1.5) and pol.seconds[0] == pytest.approx(1.3)
    zero = np.zeros((1, 3, 7))
    assert pol.timed_at == [3, 6, 9]  # the switch step back to candidate 0 timed nothing
    assert pol.steps == 11 and pol.choose(zero, np.ones(1)) == 0  # steps % 12 == 11: the least recently timed
    _observe(pol, 0, 1.0)
    assert pol.choose(zero, np.ones(1)) == 0 and pol.trying == 0  # a trial runs TRIAL timed steps
    _observe(pol, 0, 1.0)
    assert pol.timed_at[0] == 12 and pol.choose(zero, np.ones(1)) in (0, 1, 2) and pol.trying is None


def test_a_better_candidate_is_taken_only_when_it_repays_the_switch():
    pol = autobudget.Policy(CANDS, explore_every=0, refit_every=0, horizon=10)
    for i in (2, 2, 2, 0, 0, 0, 1, 1, 1):
        _observe(pol, i, 1.0 if i == 2 else 0.010)
    pol.switch_s = 0.020  # 10 steps of candidate 0 at 10 ms would pay 20 ms to switch
    s = np.zeros((1, 3, 7))
    s[0, 0, :2] = 1.0  # candidate 1 expects 3 tokens a step, candidate 0 expects...
    s[0, 1, :2] = 1.0
    s[0, 0, 2] = 0.1  # ... 3.1: just better, not enough to repay the switch from the current candidate 1
    assert pol.last == 1 and pol.choose(s, np.ones(1)) == 1
    s[0, 0, 2:] = 1.0  # 8 tokens a step: 10 steps of it repay the switch
    assert pol.choose(s, np.ones(1)) == 0


def test_calibration_finds_an_overconfident_drafter():
    """Accept lengths drawn as if P(tau >= a + 1) were S_a^2: the refit gamma comes out near 2, and E[tau] uses it."""
    rng = np.random.default_rng(2)
    pol = autobudget.Policy(CANDS, explore_every=0, refit_every=50)
    for _ in range(400):
        s = _survival(rng, C=4)
        u = rng.random(4)
        accept = 1 + (s[:, 1] ** 2 > u[:, None]).sum(-1)  # tau >= a + 1 iff u < S_a^2 (S non-increasing)
        pol.observe(1, 0.01, s, accept, np.ones(4, bool))
    assert 1.7 < pol.gamma < 2.3, pol.gamma
    s = _survival(rng)
    np.testing.assert_allclose(pol.taus(s), 1 + (s**pol.gamma).sum(-1))


def test_a_step_reports_the_survival_budget_estimates_from_its_draft():
    """RandomDraft's logits are a known function of the step: the state's survival after one step equals
    budget.candidate_taus on them, and DDTree verifies that build's prefix (lossless against AR below)."""
    model = k26jax.load(TINY, dtype="float32")
    sc = engine.StepConfig(method="ddtree", budget=8, max_new_tokens=8, estimate=CANDS)
    draft = engine.RandomDraft(seed=3)
    dec = engine.Decoder(model.cfg, model.drafter_cfg, sc, model.impls, drafter=draft)
    ids = np.arange(1, 25, dtype=np.int32).reshape(2, 12)
    state = dec.prefill(model.params, model.drafter_params, ids, np.array([12, 9]), jax.random.key(0), max_len=64)
    state = dec.step(model.params, model.drafter_params, state)
    logits = draft.propose(None, None, dataclasses.replace(state, step=state.step - 1), cfg=model.cfg, dcfg=None, sc=sc)
    want = budget.candidate_taus(logits, CANDS, impls=model.impls).survival
    np.testing.assert_allclose(np.asarray(state.survival), np.asarray(want), rtol=1e-6, atol=1e-7)
    assert state.survival.shape == (2, len(CANDS), sc.depth) and float(np.min(want[:, :, 0])) > 1e-4
    stale = engine.Decoder(model.cfg, model.drafter_cfg, dataclasses.replace(sc, estimate_stale=True), model.impls,
                           drafter=draft)  # fmt: skip
    before = np.asarray(state.survival)
    kept = stale.step(model.params, model.drafter_params, jax.tree.map(lambda x: x.copy(), state))  # steps donate
    after = dec.step(model.params, model.drafter_params, state)
    np.testing.assert_array_equal(np.asarray(kept.survival), before)  # not rebuilt
    assert not np.array_equal(np.asarray(after.survival), before)
    # the stale step builds its own B = 8 tree; the estimating one verifies the B = 128 build's prefix: equal
    own, none, own_top1 = engine.build_tree(logits, sc=stale.sc, impls=model.impls)
    prefix, _, top1 = engine.build_tree(logits, sc=sc, impls=model.impls)
    assert none is None and int(own[3].min()) == 8
    for a, b in zip(own, prefix):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for t in (own_top1, top1):  # the draft's top-1 per depth, from either build's top-K
        np.testing.assert_array_equal(np.asarray(t), np.argmax(np.asarray(logits), axis=-1))


def test_auto_decoding_emits_ar_tokens_and_reports_its_choices():
    """float32 greedy: whatever candidates the policy runs (three here, the smallest and the largest default
    budgets among them: three chunk programs, each tried for a chunk), the tokens are AR's, streamed as they come;
    the second call reuses the compiled chunks and the measured times."""
    cands = autobudget.parse_candidates("chain,ddtree8,ddtree128")
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        model = k26jax.load(TINY, dtype="float32")
        prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
        n = 3 * autobudget.CHUNK_STEPS + 4  # the random tiny pair accepts ~1 token a step: 3 chunks and a bit
        ar = generate(model, prompts, max_new_tokens=n, method="ar")
        streamed = [[], []]
        first = generate(model, prompts, max_new_tokens=n, budget="auto", auto_candidates=cands,
                         on_tokens=lambda i, ids: streamed[i].extend(ids))  # fmt: skip
        again = generate(model, prompts, max_new_tokens=n, budget="auto", auto_candidates=cands)
    finally:
        jax.config.update("jax_default_matmul_precision", None)
    assert first.tokens == ar.tokens == again.tokens == streamed  # chunks stream each token once, in order
    a = first.stats["auto"]
    assert first.stats["budget"] == "auto" and sum(a["choices"].values()) == first.stats["steps"]
    assert all(a["choices"].get(autobudget.label(c), 0) >= autobudget.CHUNK_STEPS for c in cands)  # each tried
    assert set(a["step_ms"]) == {autobudget.label(c) for c in cands} and a["host_ms"] > 0
    assert sum(again.stats["auto"]["choices"].values()) == again.stats["steps"]
    assert again.stats["compile_s"] < first.stats["compile_s"]


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(budget="auto", method="chain"), "needs method='ddtree'"),
        (dict(budget="auto", loop="while"), "loop='python'"),
        (dict(budget="big"), "positive integer or 'auto'"),
    ],
)
def test_bad_budget_arguments_are_named(kw, words):
    model = k26jax.load(TINY, dtype="float32")
    with pytest.raises(ValueError, match=words):
        generate(model, [[1, 2, 3]], max_new_tokens=4, **kw)


def _regime(hard: bool):
    """Survival [1, 3, 7]: on an easy step every candidate expects ~7.3 tokens, on a hard one the big tree 4.5
    against 2.4 (the step times below make the tree the better choice only on hard steps)."""
    s = np.full((1, 3, 7), 0.2 if hard else 0.9)
    s[0, 2] = 0.5 if hard else 0.92
    return s


@pytest.mark.parametrize("persistent", [False, True])
def test_a_stale_estimate_is_trusted_as_far_as_it_predicts_the_next_step(persistent):
    """The choice is one step stale. Where hard steps come at random the last step's estimate says nothing about
    the next one: rho ~ 0 and the candidate with the best mean rate is kept. Where hardness persists, rho ~ 1
    and a hard step moves the choice to the big tree."""
    rng = np.random.default_rng(3)
    pol = autobudget.Policy(CANDS, explore_every=0, refit_every=0)
    times = (0.010, 0.011, 0.015)
    for i, t in enumerate(times):
        for _ in range(3):
            _observe(pol, i, t)
    for k in range(300):
        hard = (k // 25) % 2 == 1 if persistent else rng.random() < 0.5
        pol.observe(0, times[0], _regime(hard), np.ones(1, int), np.ones(1, bool))
    assert (pol.rho > 0.7) if persistent else (pol.rho < 0.3), pol.rho
    assert pol.choose(_regime(hard=True), np.ones(1)) == (2 if persistent else 0)
    assert pol.choose(_regime(hard=False), np.ones(1)) == 0


def test_stats_compare_the_tau_each_candidate_was_chosen_on_with_what_it_got():
    """A drafter whose estimates run high shows as tau_chosen_on above tau_realised for the candidates chosen."""
    pol = autobudget.Policy(CANDS, explore_every=0, refit_every=0)
    s = np.zeros((2, 3, 7))
    s[:, :, :3] = 0.9  # every candidate expects 1 + 2.7 = 3.7 tokens a slot
    for _ in range(12):
        i = pol.choose(s, np.ones(2))
        pol.observe(i, 0.01 * (i + 1), s, np.array([2, 3]), np.ones(2, bool))  # it gets 2.5
    stats = pol.stats()
    assert set(stats["tau_chosen_on"]) == {autobudget.label(c) for c in CANDS}  # all tried
    for name in stats["tau_chosen_on"]:
        assert stats["tau_chosen_on"][name] == pytest.approx(3.7) and stats["tau_realised"][name] == 2.5


def test_with_estimate_every_k_only_plain_steps_are_timed_and_only_estimates_are_learnt_from():
    """An estimating step's extra time is estimate_ms, not the candidate's step time; a step with no estimate
    adds no calibration pair and the choice keeps using the last estimate."""
    rng = np.random.default_rng(4)
    pol = autobudget.Policy(CANDS, estimate_every=4, explore_every=0, refit_every=0, rho_prior=1.0)
    for i, t in enumerate((0.010, 0.012, 0.030)):
        pol.observe(i, t, None, np.ones(1, int), np.ones(1, bool))  # a switch step
        for _ in range(2):
            pol.observe(i, t, None, np.ones(1, int), np.ones(1, bool))
    pairs = len(pol.predicted)
    for _ in range(4):
        pol.observe(2, 0.034, _survival(rng, C=1), np.ones(1, int), np.ones(1, bool))  # estimating: 4 ms more
    assert pol.seconds == pytest.approx([0.010, 0.012, 0.030]) and pol.estimate_s == pytest.approx(0.004)
    assert pol.stats()["estimate_ms"] == pytest.approx(4.0) and len(pol.predicted) == pairs + 4 * 7
    s = np.zeros((1, 3, 7))
    s[0, 2] = 1.0  # the big tree expects 8 tokens, the others 1: worth its 3x step time
    assert pol.choose(s, np.ones(1)) == 2
    pol.observe(2, 0.030, None, np.ones(1, int), np.ones(1, bool))
    assert pol.choose(None, np.ones(1)) == 2 and len(pol.predicted) == pairs + 4 * 7


def test_before_rho_is_known_the_estimates_mean_predicts_the_next_steps():
    """With rho_prior 0 (the default), until PREDICT_AFTER estimates the prediction is their plain mean, not the
    last one (a stale estimate under difficulty drawn afresh each step says nothing; the mean is the best guess)."""
    rng = np.random.default_rng(5)
    pol = autobudget.Policy(CANDS, explore_every=0, refit_every=0)
    seen = [_survival(rng, C=1) for _ in range(3)]
    for s in seen:
        pol.observe(0, 0.01, s, np.ones(1, int), np.ones(1, bool))
    assert pol.rho == 0.0
    want = np.mean([1 + s[0].sum(-1) for s in seen], axis=0)
    np.testing.assert_allclose(pol.expected_tokens(seen[-1], np.ones(1)), want)
    np.testing.assert_allclose(pol.expected_tokens(_survival(rng, C=1), np.ones(1)), want)  # whatever the last


class _Exe:
    """A fake compiled step: records which candidate / executable ran; the state is a step counter."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def __call__(self, params, dparams, state):
        self.log.append(self.name)
        return state + 1


@pytest.mark.parametrize("every", [1, 2, 8])
def test_one_step_in_estimate_every_runs_the_estimating_executable(every):
    """AutoDecoder.step runs a candidate's estimating executable on the first step after prepare and then one
    step in `every`, its stale twin otherwise; observe hands the policy a survival only after estimating steps."""
    model = k26jax.load(TINY, dtype="float32")
    sc = engine.StepConfig(method="ddtree", budget=8, max_new_tokens=8)
    auto = autobudget.AutoDecoder(model.cfg, model.drafter_cfg, sc, model.impls, CANDS, estimate_every=every)
    assert [len(pair) for pair in auto.decoders] == [1 if every == 1 else 2] * len(CANDS)
    assert all(p[-1].sc.estimate_stale == (every > 1) and p[0].sc.estimate == CANDS for p in auto.decoders)
    log, seen = [], []
    auto.executables = [tuple(_Exe(log, (i, k)) for k in range(len(p))) for i, p in enumerate(auto.decoders)]
    auto.policy = autobudget.Policy(CANDS, estimate_every=every)
    auto.policy.observe = lambda choice, seconds, survival, *a, **kw: seen.append(survival is not None)
    auto.policy.choose = lambda survival, active: 1
    auto.fresh, auto._since = True, 0  # as prepare leaves it
    state = 0
    for _ in range(3 * every + 1):
        state = auto.step(None, None, state)
        host = {"survival": np.zeros((2, 3, 7)), "num_emitted": np.ones(2), "done": np.zeros(2)}
        auto.observe(host | {"realised": np.zeros((2, 3), np.int32)}, np.zeros(2))
    want = [k % every == 0 for k in range(3 * every + 1)]
    assert seen == want and log == [(0 if k == 0 else 1, 0 if w else 1) for k, w in enumerate(want)]


def test_the_step_after_an_estimating_one_is_not_timed_and_a_new_request_counts_at_the_mean():
    """The first plain step after an estimating step follows another executable, so it times nothing; a slot
    the server refilled after the last estimate is predicted by the running mean, not by that estimate's row."""
    pol = autobudget.Policy(CANDS, estimate_every=4, explore_every=0, refit_every=0)
    for i, t in enumerate((0.010, 0.012, 0.030)):
        for _ in range(3):
            pol.observe(i, t, None, np.ones(1, int), np.ones(1, bool))
    full, empty = np.ones((2, 3, 7)), np.zeros((2, 3, 7))
    pol.observe(2, 0.034, full, np.ones(2, int), np.ones(2, bool))  # an estimating step: every slot expects 8
    pol.observe(2, 0.050, None, np.ones(2, int), np.ones(2, bool))  # after it: not a step time
    assert pol.seconds[2] == pytest.approx(0.030) and pol.timed[2] == 2
    pol.choose(full, np.ones(2))
    np.testing.assert_allclose(pol.chosen_tau, 8.0)
    pol.forget(1)
    pol.choose(None, np.ones(2))
    np.testing.assert_allclose(pol.chosen_tau, (8.0 + pol.mean) / 2)  # slot 1 at the running mean
    pol.observe(2, 0.030, empty, np.ones(2, int), np.ones(2, bool))
    pol.choose(empty, np.ones(2))  # a fresh estimate speaks for both slots again
    assert pol.known.all()


def test_candidates_parse_by_label_and_refuse_by_name():
    assert autobudget.parse_candidates("chain, ddtree16") == (("chain", 7), ("ddtree", 16))
    assert autobudget.parse_candidates(",".join(map(autobudget.label, autobudget.CANDIDATES))) == autobudget.CANDIDATES
    for bad, said in (
        ("ddtree0", "'ddtree0'"),
        ("tree8", "'tree8'"),
        ("ddtree9999", "1..4095"),
        ("chain,chain", "twice"),
    ):
        with pytest.raises(ValueError, match=said):
            autobudget.parse_candidates(bad)


def test_a_chunk_is_its_estimating_step_then_stale_steps_as_single_steps_run_them():
    """decode_chunk (generate's auto dispatch) equals its candidate's estimating step and then its stale steps
    run one at a time: the same tokens, accept lengths and survival; its head is the first step's."""
    model = k26jax.load(TINY, dtype="float32")
    sc = engine.StepConfig(method="ddtree", budget=8, max_new_tokens=24)
    auto = autobudget.ChunkedAutoDecoder(model.cfg, model.drafter_cfg, sc, model.impls, CANDS[:2])
    est, stale = auto.decoders[1]
    args = model.params, model.drafter_params
    ids = np.arange(1, 25, dtype=np.int32).reshape(2, 12)
    state = est.prefill(*args, ids, np.array([12, 9]), jax.random.key(0), max_len=64)
    one = est.step(*args, jax.tree.map(lambda x: x.copy(), state))  # steps donate their state
    head_want = jax.device_get({"step": 0, "num_out": state.num_out, "accept": one.num_emitted, "done": one.done})
    for _ in range(3):
        one = stale.step(*args, one)
    got, head = auto.chunks[1](*args, state, np.int32(4))
    assert int(got.step) == int(one.step) == 4
    for f in ("out", "num_out", "accept_lens", "done", "root"):
        np.testing.assert_array_equal(np.asarray(getattr(got, f)), np.asarray(getattr(one, f)), err_msg=f)
    np.testing.assert_allclose(np.asarray(got.survival), np.asarray(one.survival), rtol=1e-6)
    for k, v in head_want.items():
        np.testing.assert_array_equal(np.asarray(head[k]), v, err_msg=k)


def test_every_chunk_runs_chunk_steps_and_one_cut_short_is_not_timed():
    """A trial's chunk is as long as a chosen one's (so every candidate's time a step carries the same share of a
    chunk's fixed costs), and a chunk that stops early (its sequences ended) is not timed, unless its candidate
    has no time yet (generations shorter than a chunk still try every candidate)."""
    model = k26jax.load(TINY, dtype="float32")
    sc = engine.StepConfig(method="ddtree", budget=8, max_new_tokens=8)
    auto = autobudget.ChunkedAutoDecoder(model.cfg, model.drafter_cfg, sc, model.impls, CANDS)
    auto.policy = autobudget.Policy(CANDS, chunked=True, trial=1, explore_every=0)
    asked, stop_after = [], {}

    def chunk(params, dparams, state, num_steps):
        asked.append(int(num_steps))
        ran = min(int(num_steps), stop_after.get("n", int(num_steps)))
        head = {"step": state.step, "num_out": state.num_out, "accept": np.ones(1, np.int32), "done": np.zeros(1, bool)}
        return dataclasses.replace(state, step=state.step + ran, num_out=state.num_out + ran), head

    auto.executables = [chunk] * len(CANDS)
    fields = ["step", "survival", "done", "num_out", "realised"]
    state = dataclasses.make_dataclass("State", fields)(
        0, np.zeros((1, len(CANDS), 7)), np.zeros(1, bool), np.zeros(1), np.zeros((1, len(CANDS)), np.int32)
    )
    auto.choice = auto.policy.choose(None, np.ones(1))
    for _ in range(len(CANDS) + 2):  # every candidate's trial, then chosen chunks
        state = auto.step(None, None, state)
        auto.observe(auto.fields(state), np.zeros(1, bool))
    assert asked == [autobudget.CHUNK_STEPS] * (len(CANDS) + 2)
    assert min(auto.policy.timed) == 1 and sum(auto.policy.timed) == len(CANDS) + 2
    timed = sum(auto.policy.timed)
    stop_after["n"] = 3  # the sequences end 3 steps in
    state = auto.step(None, None, state)
    auto.observe(auto.fields(state), np.zeros(1, bool))
    assert sum(auto.policy.timed) == timed and auto.policy.steps == (len(CANDS) + 2) * autobudget.CHUNK_STEPS + 3
    fresh = autobudget.Policy(CANDS, chunked=True, trial=1, explore_every=0)
    auto.policy, auto.choice = fresh, fresh.choose(None, np.ones(1))
    for _ in range(len(CANDS)):  # every chunk cut short: each candidate is still timed once, then tried no more
        state = auto.step(None, None, state)
        auto.observe(auto.fields(state), np.zeros(1, bool))
    assert fresh.timed == [1] * len(CANDS) and fresh.trying is None


def test_a_chunk_is_timed_from_before_its_dispatch_so_one_that_blocks_it_counts_whole():
    """On a GPU a chunk's while_loop reads its predicate on the host each iteration, so the dispatch returns only
    near the chunk's end: its time runs from before the dispatch to its result on the host (a chunk that blocks
    10 ms a step reads 10 ms a step, not the little left after the call returned)."""
    model = k26jax.load(TINY, dtype="float32")
    sc = engine.StepConfig(method="ddtree", budget=8, max_new_tokens=8)
    auto = autobudget.ChunkedAutoDecoder(model.cfg, model.drafter_cfg, sc, model.impls, CANDS)
    auto.policy, auto.choice = autobudget.Policy(CANDS, chunked=True, trial=1), 0

    def blocking(params, dparams, state, num_steps):
        time.sleep(0.01 * int(num_steps))
        head = {"step": state.step, "num_out": state.num_out, "accept": np.ones(1, np.int32), "done": np.zeros(1, bool)}
        return dataclasses.replace(
            state, step=state.step + int(num_steps), num_out=state.num_out + int(num_steps)
        ), head

    auto.executables = [blocking] * len(CANDS)
    fields = ["step", "survival", "done", "num_out", "realised"]
    state = dataclasses.make_dataclass("State", fields)(
        0, np.zeros((1, len(CANDS), 7)), np.zeros(1, bool), np.zeros(1), np.zeros((1, len(CANDS)), np.int32)
    )
    while auto.policy.timed[0] < 1:
        state = auto.step(None, None, state)
        auto.observe(auto.fields(state), np.zeros(1, bool))
    assert 0.01 <= auto.policy.seconds[0] < 0.5  # the buggy timing read ~1e-5 s


def test_chunked_auto_times_candidates_alike_and_picks_the_best_rate():
    """A simulated GPU: a chunk costs a fixed 3 ms (dispatch, the loop's end, the fetch) plus its steps; each
    candidate's step time and accept length are fixed (tau over step time: the middle one is best by 20%). Every
    candidate's measured time a step carries the same share of the fixed cost, so the policy picks the best rate.
    (With 2-step trial chunks against long chosen ones, as before 5bc75aa, the first choice looked cheapest.)"""
    model = k26jax.load(TINY, dtype="float32")
    sc = engine.StepConfig(method="ddtree", budget=8, max_new_tokens=8)
    cands = (("chain", 7), ("ddtree", 32), ("ddtree", 128))
    step_s, tau, fixed_s = (0.00085, 0.0010, 0.0014), (2.4, 3.4, 3.7), 0.003
    auto = autobudget.ChunkedAutoDecoder(model.cfg, model.drafter_cfg, sc, model.impls, cands)
    auto.policy = autobudget.Policy(cands, chunked=True, trial=1, explore_every=0)
    survival = np.repeat(((np.array(tau) - 1) / 7)[None, :, None], 7, axis=2)  # E[tau] = tau: a calibrated drafter

    def chunk_of(c):
        def chunk(params, dparams, state, num_steps):
            time.sleep(fixed_s + int(num_steps) * step_s[c])
            n = int(num_steps)
            head = {"step": state.step, "num_out": state.num_out, "accept": np.full(1, round(tau[c])), "done": [False]}
            return dataclasses.replace(state, step=state.step + n, num_out=state.num_out + n * tau[c]), head

        return chunk

    auto.executables = [chunk_of(c) for c in range(len(cands))]
    fields = ["step", "survival", "done", "num_out", "realised"]
    state = dataclasses.make_dataclass("State", fields)(
        0, survival, np.zeros(1, bool), np.zeros(1), np.zeros((1, len(cands)), np.int32)
    )
    auto.choice = auto.policy.choose(None, np.ones(1))
    chosen = []
    for _ in range(len(cands) + 3):  # the trials, then three chosen chunks
        chosen.append(auto.choice)
        state = auto.step(None, None, state)
        auto.observe(auto.fields(state), np.zeros(1, bool))
    assert chosen[len(cands) :] == [1, 1, 1], (chosen, auto.policy.stats())
    want = np.array(step_s) + fixed_s / autobudget.CHUNK_STEPS
    got = np.array(auto.policy.seconds)
    np.testing.assert_allclose(got / got[1], want / want[1], rtol=0.1)  # alike: ratios, not absolute sleeps


def test_chunks_of_steps_count_as_steps_and_each_explore_period_retries_once():
    """observe(steps=n): a chunk counts n steps, and a switch chunk's extra a step counts n times (once a switch);
    when chunks jump past an explore_every boundary (not onto its last step, as single steps do), the stalest
    candidate is still retried, once in that period."""
    pol = autobudget.Policy(CANDS, explore_every=30, refit_every=0)
    for i in (0, 0, 0, 1, 1, 1, 2, 2, 2):
        _observe(pol, i, 1.0)
    zero, starts = np.zeros((1, 3, 7)), []
    for _ in range(12):  # 9 + 12 chunks of 5 steps: periods 1 and 2 begin inside the chunks at 29 and 59
        before = pol.explored
        i = pol.choose(zero, np.ones(1))
        if pol.explored > before:
            starts.append((pol.steps, i))
        pol.observe(i, 1.0, zero, np.ones(1, int), np.zeros(1, bool), steps=5)
    assert pol.steps == 69 and sum(pol.counts) == 69
    assert starts == [(29, 0), (59, 1)]  # each time the least recently timed candidate
    other, old = (pol.last + 1) % len(CANDS), pol.switch_s
    pol.observe(other, pol.seconds[other] + 0.2, zero, np.ones(1, int), np.zeros(1, bool), steps=5)
    assert pol.switch_s == pytest.approx((1 - autobudget.EMA) * old + autobudget.EMA * 1.0)  # 0.2 s x 5 steps


def test_a_candidate_whose_steps_realise_more_than_its_estimates_is_corrected_up():
    """A drafter that underrates its trees: the tree's estimates say 3 tokens for 2x a chain's time, against the
    chain's 2, so it loses on estimates; its steps realise 6. Each candidate's correction (realised over estimated,
    shrunk toward 1 by CORRECTION_PRIOR steps) makes the tree the choice, and the stats say by how much."""
    cands = (("chain", 7), ("ddtree", 32))
    pol = autobudget.Policy(cands, explore_every=0, refit_every=0)
    s = np.zeros((1, 2, 7))
    s[0, 0, :1], s[0, 1, :2] = 1.0, 1.0  # E[tau]: chain 2, tree 3
    realised = {0: 2, 1: 6}
    for _ in range(6):  # the trials: each candidate's switch step and two timed ones
        i = pol.choose(s, np.ones(1))
        pol.observe(i, 0.01 * (i + 1), s, np.array([realised[i]]), np.ones(1, bool))
    assert pol.choose(s, np.ones(1)) == 0  # 3 x 1.09 / 0.02 < 2 / 0.01: not enough evidence yet
    for _ in range(20):
        pol.observe(1, 0.02, s, np.array([6]), np.ones(1, bool))
    k = pol.corrections()
    prior = autobudget.CORRECTION_PRIOR
    assert k[0] == pytest.approx(1.0) and k[1] == pytest.approx((23 * 6 + prior * 3) / (23 * 3 + prior * 3))
    assert pol.choose(s, np.ones(1)) == 1
    assert pol.stats()["tau_correction"] == {"chain": 1.0, "ddtree32": round(float(k[1]), 3)}


def test_a_chunk_speaks_for_all_its_steps_in_the_correction():
    """observe(steps=n, realised=...): a chunk adds n steps at its mean accept length a step over its slots still
    decoding at its end (its head's accept lengths stay the calibration's), so one 40-step chunk outweighs the
    prior and a slot that finished inside it does not count."""
    pol = autobudget.Policy(CANDS, explore_every=0, refit_every=0)
    s = np.zeros((2, 3, 7))
    s[:, :, :2] = 1.0  # every candidate expects 3 a step
    pol.choose(s, np.ones(2))
    realised = (np.array([6.0, 1.0]), np.array([True, False]))  # slot 1 finished inside the chunk
    pol.observe(2, 0.01, s, np.array([3, 3]), np.ones(2, bool), steps=40, realised=realised)
    prior = autobudget.CORRECTION_PRIOR
    assert pol.tau_sums[2].tolist() == [40, 40 * 3.0, 40 * 6.0]
    assert pol.corrections()[2] == pytest.approx((240 + prior * 3) / (120 + prior * 3))
    assert len(pol.observed) == 2 * 7 and sum(pol.observed) == 2 * 2  # the head's pairs: both slots accepted 3


def test_what_a_step_tells_of_other_candidates_counts_toward_their_corrections():
    """observe(counterfactual=...): the candidates whose accept length the step's tree told (non-zero over the
    valid slots) each add one step at that length; the chosen one counts once (its own accept), the others (0:
    a larger tree) not at all."""
    pol = autobudget.Policy(CANDS, explore_every=0, refit_every=0)
    s = np.zeros((2, 3, 7))
    s[:, :, :1] = 1.0  # every candidate expects 2 a step
    pol.choose(s, np.ones(2))
    told = np.array([[3, 4, 5], [5, 6, 0]])  # slot 1 is not valid: its 0 says nothing
    pol.observe(1, 0.01, s, np.array([4, 6]), np.ones(2, bool), counterfactual=(told, np.array([True, False])))
    assert pol.tau_sums.tolist() == [[1, 2.0, 3.0], [1, 2.0, 5.0], [1, 2.0, 5.0]]
    told[0, 2] = 0  # candidate 2's tree is larger than the step's
    pol.observe(1, 0.01, s, np.array([4, 6]), np.ones(2, bool), counterfactual=(told, np.ones(2, bool)))
    assert pol.tau_sums[0].tolist() == [2, 4.0, 7.0] and pol.tau_sums[2].tolist() == [1, 2.0, 5.0]
