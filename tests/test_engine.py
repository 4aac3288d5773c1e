"""The speculative engine: losslessness, plumbing with oracle drafters, sampling law, cache commit, mesh."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from k26jax import api, engine, ops, sharding
from k26jax.config import ConfigError, DrafterConfig, preset
from k26jax.generation import generate
from k26jax.model import drafter, target

IMPLS = ops.Impls()
PROMPTS = [[5, 17, 300, 42, 9], [700, 3, 88], list(range(100, 120))]
NEW = 64
L = 7


def tiny_drafter_cfg(vocab=1024):
    return DrafterConfig.from_dict(
        dict(
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=512,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            block_size=L + 1,
            num_target_layers=4,
            vocab_size=vocab,
            max_position_embeddings=4096,
            dflash_config=dict(target_layer_ids=[1, 2], mask_token_id=vocab - 2),
        )
    )


def make_model(cfg, seed=0):
    dcfg = tiny_drafter_cfg(cfg.vocab_size)
    return api.Model(
        cfg,
        target.init_params(cfg, seed, jnp.float32),
        IMPLS,
        drafter_cfg=dcfg,
        drafter_params=drafter.init_params(dcfg, seed, jnp.float32),
    )


@pytest.fixture(scope="module")
def model():
    return make_model(preset("tiny"))


@pytest.fixture(scope="module")
def ar(model):
    """AR greedy tokens and, per generated position, the float32 top-1/top-2 margin."""
    tokens = generate(model, PROMPTS, max_new_tokens=NEW, method="ar").tokens
    safe = []
    for p, t in zip(PROMPTS, tokens):
        logits = np.asarray(model.logits(np.array([p + t])))[0, len(p) - 1 : -1]
        top2 = np.sort(logits, -1)[:, -2:]
        margins = top2[:, 1] - top2[:, 0]
        safe.append(int(np.argmax(margins < 1e-4)) if (margins < 1e-4).any() else len(t))
    return tokens, safe


@dataclasses.dataclass(frozen=True, eq=False)
class Oracle:
    """Noisy oracle drafter (an engine.Drafter): the target's true next tokens; with prob `noise` a depth is
    corrupted, half the time with the true token ranked 2nd (a tree can still recover it), half the time absent."""

    trajectory: np.ndarray
    noise: float
    seed: int = 0

    def propose(self, params, dparams, state, *, cfg, dcfg, sc):
        traj = jnp.asarray(self.trajectory)
        C, V = traj.shape[0], params["lm_head"].shape[1]
        idx = jnp.minimum(state.cache.lengths[:, None] + 1 + jnp.arange(L)[None], traj.shape[1] - 1)
        true = jnp.take_along_axis(traj, idx, axis=1)  # [C, L]
        k1, k2, k3 = jax.random.split(jax.random.fold_in(jax.random.key(self.seed), state.step), 3)
        logits = jax.random.normal(k1, (C, L, V))
        wrong = (true + jax.random.randint(k2, true.shape, 1, V)) % V
        u = jax.random.uniform(k3, true.shape)
        bad = u < self.noise
        true_boost = jnp.where(u < self.noise / 2, 0.0, jnp.where(bad, 8.0, 10.0))
        logits = logits.at[jnp.arange(C)[:, None], jnp.arange(L)[None], true].add(true_boost)
        return logits.at[jnp.arange(C)[:, None], jnp.arange(L)[None], wrong].add(jnp.where(bad, 12.0, 0.0))


def trajectories(tokens):
    width = max(len(p) + len(t) for p, t in zip(PROMPTS, tokens)) + L + 2
    traj = np.zeros((len(PROMPTS), width), np.int32)
    for i, (p, t) in enumerate(zip(PROMPTS, tokens)):
        traj[i, : len(p) + len(t)] = p + t
    return traj


def assert_same_until_near_tie(got, ar):
    tokens, safe = ar
    for g, t, s in zip(got, tokens, safe):
        assert g[:s] == t[:s]
        assert len(g) == len(t)


@pytest.mark.parametrize("method,budget", [("chain", 1), ("ddtree", 1), ("ddtree", 4), ("ddtree", 32)])
def test_lossless_with_random_drafter(model, ar, method, budget):
    assert_same_until_near_tie(generate(model, PROMPTS, max_new_tokens=NEW, method=method, budget=budget).tokens, ar)


@pytest.mark.parametrize("method,budget", [("chain", 1), ("ddtree", 4), ("ddtree", 32)])
def test_lossless_with_noisy_oracle_and_accept_lengths_span_1_to_L_plus_1(model, ar, method, budget):
    res = generate(
        model, PROMPTS, max_new_tokens=NEW, method=method, budget=budget, drafter=Oracle(trajectories(ar[0]), 0.25)
    )
    assert_same_until_near_tie(res.tokens, ar)
    lens = {a for row in res.stats["accept_lens"] for a in row if a}
    deepest = min(L, budget if method == "ddtree" else L) + 1
    assert {1, deepest} <= lens and len(lens) >= min(4, deepest), lens
    if method == "ddtree" and budget == 32:
        assert res.stats["tau"] > 4


def test_perfect_oracle_accepts_full_depth_every_step(model, ar):
    res = generate(
        model,
        PROMPTS,
        max_new_tokens=NEW,
        method="ddtree",
        budget=L,
        drafter=Oracle(trajectories(ar[0]), noise=0.0),
        loop="while",
    )
    assert_same_until_near_tie(res.tokens, ar)
    # 1 token from prefill, then full steps of L+1 tokens until the last, capped by max_new_tokens.
    full_steps = (NEW - 1) // (L + 1)
    for step_lens in res.stats["accept_lens"][:full_steps]:
        assert step_lens == [L + 1] * len(PROMPTS)
    assert res.stats["steps"] == -(-(NEW - 1) // (L + 1))


def test_cache_commit_equals_prefill_of_the_emitted_tokens(model, ar):
    sc = engine.StepConfig(method="ddtree", budget=16, max_new_tokens=NEW, block_size=L + 1)
    ids = np.zeros((3, 32), np.int32)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = p
    lengths = np.array([len(p) for p in PROMPTS], np.int32)
    dec = engine.Decoder(model.cfg, model.drafter_cfg, sc, IMPLS, drafter=Oracle(trajectories(ar[0]), 0.3))
    state = dec.prefill(model.params, model.drafter_params, ids, lengths, jax.random.key(0), max_len=128)
    for _ in range(4):
        state = dec.step(model.params, model.drafter_params, state)
    prefill = jax.jit(target.forward_prefill, static_argnames=("cfg", "impls"))  # compiled, not run op by op
    for i, p in enumerate(PROMPTS):
        n = int(state.cache.lengths[i])
        seq = (p + ar[0][i])[:n]
        assert n == len(p) + int(state.num_out[i]) - 1  # the last emitted token is the next root, no KV yet
        _, rows, _ = prefill(
            model.params, cfg=model.cfg, ids_BT=jnp.asarray([seq]), lengths_B=jnp.asarray([n]), impls=IMPLS
        )
        np.testing.assert_allclose(state.cache.rows[:, i, :n], rows[:, 0], atol=2e-5)


def test_counterfactual_accept_lengths_are_what_each_candidates_own_tree_accepts(model, ar):
    """A step with estimate candidates reports per candidate the accept length its tree gets from the same state,
    where the step's own tree tells it: exactly, for DDTree budgets up to the step's (prefixes of its best-first
    tree); for the chain exactly, or a lower bound where every known target token was the draft's top-1; 0 for a
    larger tree."""
    cands = (("chain", L), ("ddtree", 2), ("ddtree", 8), ("ddtree", 16), ("ddtree", 64))
    oracle = Oracle(trajectories(ar[0]), 0.3)

    def decoder(method, b, estimate=()):
        sc = engine.StepConfig(method=method, budget=b, max_new_tokens=NEW, block_size=L + 1, estimate=estimate)
        return engine.Decoder(model.cfg, model.drafter_cfg, sc, IMPLS, drafter=oracle)

    big, args = decoder("ddtree", 16, cands), (model.params, model.drafter_params)
    own = [decoder(m, b) for m, b in cands[:3]]
    ids = np.zeros((3, 32), np.int32)
    for i, p in enumerate(PROMPTS):
        ids[i, : len(p)] = p
    state = big.prefill(*args, ids, np.array([len(p) for p in PROMPTS]), jax.random.key(0), max_len=128)
    seen = set()
    for _ in range(4):
        copy = lambda: jax.tree.map(lambda x: x.copy(), state)  # steps donate their state
        actual = [np.asarray(d.step(*args, copy()).num_emitted) for d in own]
        state = big.step(*args, state)
        got, accept = np.asarray(state.realised), np.asarray(state.num_emitted)
        live = ~np.asarray(state.done)
        np.testing.assert_array_equal(got[live, 1:3], np.stack(actual[1:], 1)[live])  # DDTree 2 and 8
        np.testing.assert_array_equal(got[live, 3], accept[live])  # the step's own candidate
        chain = actual[0][live]
        bound = got[live, 0] == accept[live] + 1
        assert (got[live, 0] <= chain).all() and ((got[live, 0] == chain) | bound).all()
        assert (got[:, 4] == 0).all()  # DDTree 64: larger than the step's tree
        seen |= {tuple(row) for row in got[live, :4]}
    assert len(seen) >= 3  # the candidates' accept lengths differ between steps and from each other


def test_eight_devices_equal_one_device(model):
    mesh = sharding.make_mesh(8)
    placed = api.place(model.params, model.cfg, mesh, "ep")
    on_mesh = api.Model(model.cfg, placed, ops.Impls(mesh=mesh), mesh, model.drafter_cfg, model.drafter_params)
    kw = dict(max_new_tokens=24, method="ddtree", budget=8)
    assert generate(on_mesh, PROMPTS, **kw).tokens == generate(model, PROMPTS, **kw).tokens


def test_sampling_at_t1_follows_the_ar_distribution():
    """Chi-square: DDTree's 2nd and 3rd sampled tokens (tree depth >= 2) vs the exact AR marginals."""
    V = 8
    cfg = preset("tiny").replace(vocab_size=V, bos_token_id=None, eos_token_ids=(), pad_token_id=None)
    m = make_model(cfg, seed=1)
    m.params["lm_head"] = m.params["lm_head"] * 0.05  # a spread-out target distribution
    prompt = [1, 5, 2]
    probs = lambda seqs: np.asarray(jax.nn.softmax(m.logits(np.array(seqs))[:, -1], -1), np.float64)
    p1 = probs([prompt])[0]
    p12 = probs([prompt + [a] for a in range(V)])  # [x1, x2]
    p2 = p1 @ p12
    p3 = np.einsum("a,ab,abc->c", p1, p12, np.stack([probs([prompt + [a, b] for b in range(V)]) for a in range(V)]))
    n = 1200
    res = generate(m, [prompt] * n, max_new_tokens=3, method="ddtree", budget=16, temperature=1.0, seed=3)
    toks = np.array(res.tokens)
    assert max(max(r) for r in res.stats["accept_lens"]) >= 3  # drafts were accepted at depth >= 2
    for col, p in ((1, p2), (2, p3)):
        counts = np.bincount(toks[:, col], minlength=V)
        assert stats.chisquare(counts, p / p.sum() * n).pvalue > 1e-3, (counts, p * n)


def test_bad_input(model):
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        generate(model, [[1, 2], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="beyond the cache"):
        generate(model, [list(range(50))], max_new_tokens=20, max_len=64)
    with pytest.raises(ValueError, match="budget"):
        generate(model, [[1, 2]], max_new_tokens=4, budget=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [[1, 5000]], max_new_tokens=4)
    with pytest.raises(ConfigError, match="hidden_size"):
        tiny_drafter_cfg().check_target(preset("tiny").replace(hidden_size=512))


@pytest.mark.parametrize("method", ["ddtree", "ar"])
def test_step_is_one_program_without_host_callbacks(model, method):
    sc = engine.StepConfig(method=method, budget=8, max_new_tokens=8, block_size=L + 1)
    kw = dict(cfg=model.cfg, dcfg=model.drafter_cfg if method != "ar" else None, sc=sc, impls=IMPLS)
    ids = np.array([[1, 2, 3, 0]], np.int32)
    state = engine.prefill(
        model.params, model.drafter_params, ids, np.array([3], np.int32), jax.random.key(0), max_len=64, **kw
    )
    jaxpr = str(jax.make_jaxpr(functools.partial(engine.step, **kw))(model.params, model.drafter_params, state))
    assert "callback" not in jaxpr and "pure_callback" not in jaxpr


def test_eos_stops_each_sequence_at_its_first_eos(model, ar):
    tokens = ar[0]
    eos = next(t for i, t in enumerate(tokens[0]) if i >= 5 and t not in tokens[0][:i])
    m = api.Model(
        model.cfg.replace(eos_token_ids=(eos,)),
        model.params,
        IMPLS,
        drafter_cfg=model.drafter_cfg,
        drafter_params=model.drafter_params,
    )
    res = generate(
        m, PROMPTS, max_new_tokens=NEW, method="ddtree", budget=8, drafter=Oracle(trajectories(tokens), noise=0.2)
    )
    for got, want, safe in zip(res.tokens, tokens, ar[1]):
        stop = want.index(eos) + 1 if eos in want else len(want)
        n = min(stop, safe)  # compare only up to the first near-tie
        assert got[:n] == want[:n]
        if safe >= stop:
            assert len(got) == stop


def test_inserted_slots_decode_as_a_batch_with_their_own_sampling_and_limits(model, ar):
    """A server's path: prompts inserted one by one into free slots of an empty state, one executable for greedy and
    sampling slots. The greedy slots give AR's tokens (one cut at its own limit); the sampled slot does not."""
    sc = engine.StepConfig(method="ddtree", budget=8, max_new_tokens=NEW, block_size=L + 1, sampling=True)
    dec = engine.Decoder(model.cfg, model.drafter_cfg, sc, IMPLS)
    params, dparams = model.params, model.drafter_params
    state = dec.empty(batch=3, max_len=128, dtype=jnp.float32)
    # (slot, prompt index, temperature, top_p, token limit)
    plan = [(2, 0, 0.0, 1.0, NEW), (0, 1, 1.0, 0.9, NEW), (1, 2, 0.0, 1.0, 20)]
    for slot, i, t, p, limit in plan:
        ids = np.zeros((1, 32), np.int32)  # one prompt bucket: one insert executable
        ids[0, : len(PROMPTS[i])] = PROMPTS[i]
        args = (np.int32(len(PROMPTS[i])), np.uint32(7), np.float32(t), np.float32(p), np.int32(limit))
        state = dec.insert(params, dparams, state, np.int32(slot), ids, *args)
    state = dec.loop(params, dparams, state)
    out, num_out = np.asarray(state.out), np.asarray(state.num_out)
    tokens, safe = ar
    for slot, i, t, _, limit in plan:
        got = out[slot, : num_out[slot]].tolist()
        assert len(got) == limit
        if t == 0:
            assert got[: safe[i]] == tokens[i][:limit][: safe[i]]
        else:
            assert got != tokens[i]


def test_streamed_tokens_equal_the_result(model, ar):
    """on_tokens sees each step's appended tokens once, in order: together they are the result, multi-token
    accepts and the max_new_tokens cut included."""
    streamed = [[] for _ in PROMPTS]
    res = generate(
        model,
        PROMPTS,
        max_new_tokens=NEW - 3,
        method="ddtree",
        budget=8,
        drafter=Oracle(trajectories(ar[0]), 0.25),
        on_tokens=lambda i, ids: streamed[i].extend(ids),
    )
    assert streamed == res.tokens and max(max(r) for r in res.stats["accept_lens"]) > 2
