"""k26jax.routing: the expert probe against the router's own top-k, and the bias balancing."""

import os

import jax
import jax.numpy as jnp
import numpy as np

import k26jax
from k26jax import api, ops, routing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "checkpoints", "tiny")  # random weights: the mechanism, not the trained pair


def _prefill(model, impls, ids, bias=None):
    params = model.params
    if bias is not None:
        mlp = dict(params["moe"]["mlp"], router_bias=jnp.asarray(bias, params["moe"]["mlp"]["router_bias"].dtype))
        params = {**params, "moe": {**params["moe"], "mlp": mlp}}
    lengths = np.full((ids.shape[0],), ids.shape[1], np.int32)
    return jax.block_until_ready(api._prefill_jit(params, ids, lengths, model.cfg, impls, ()))


def test_the_probe_sees_each_moe_layers_top_k_and_nothing_without_it():
    model = k26jax.load(TINY, dtype="float32")
    cfg, E, k = model.cfg, model.cfg.n_routed_experts, model.cfg.num_experts_per_tok
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 20)).astype(np.int32)
    n_moe = model.params["moe"]["mlp"]["router_bias"].shape[0]
    probe = routing.ExpertProbe(E)
    _prefill(model, ops.Impls(), ids)
    assert probe.calls == []  # a build without the probe reports nothing
    _prefill(model, ops.Impls(probe=probe), ids)
    loads = probe.loads(n_moe)
    assert loads.shape == (n_moe, E) and (loads.sum(1) == ids.size * k).all()
    assert all(len(set(row)) == k for _, t in probe.calls for row in t.tolist())  # k distinct experts a token
    t = probe.touched(shards=4)
    assert t["calls"] == n_moe and 1 <= t["busiest_shard"] <= E // 4 and t["mean"] <= E
    # a bias that dwarfs the sigmoid scores decides the choice: every token must be seen at experts 3..3+k-1
    favoured = np.zeros((n_moe, E), np.float32)
    favoured[:, 3 : 3 + k] = 10.0
    probe.clear()
    _prefill(model, ops.Impls(probe=probe), ids, favoured)
    loads = probe.loads(n_moe)
    assert (loads[:, 3 : 3 + k] == ids.size).all() and loads.sum() == n_moe * ids.size * k


def test_balancing_the_bias_evens_a_random_routers_loads():
    model = k26jax.load(TINY, dtype="float32")
    ids = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (4, 64)).astype(np.int32)
    probe = routing.ExpertProbe(model.cfg.n_routed_experts)
    bias0 = np.asarray(model.params["moe"]["mlp"]["router_bias"])

    def loads(bias):
        probe.clear()
        _prefill(model, ops.Impls(probe=probe), ids, bias)
        return probe.loads(bias0.shape[0])

    bias, before, after = routing.balance_bias(loads, bias0, iters=20, step=0.03, decay=0.88)
    assert before > 1.5 and after < 1.25 and after < before
    assert routing.imbalance(loads(bias)) == after and not np.allclose(bias, bias0)


def test_a_finished_slot_reads_no_experts_and_leaves_the_live_slot_unchanged():
    """A step over two slots of which one is done routes only the live slot's tokens (the done slot's go to no
    expert), and the live slot's step is the same as when both are live."""
    from k26jax import engine

    model = k26jax.load(TINY, dtype="float32")
    E, k = model.cfg.n_routed_experts, model.cfg.num_experts_per_tok
    probe = routing.ExpertProbe(E)
    sc = engine.StepConfig(method="ddtree", budget=8, max_new_tokens=16, block_size=model.drafter_cfg.block_size)
    ids = np.random.default_rng(2).integers(0, model.cfg.vocab_size, (2, 12)).astype(np.int32)
    dec = engine.Decoder(model.cfg, model.drafter_cfg, sc, ops.Impls(probe=probe))
    state = dec.prefill(
        model.params, model.drafter_params, ids, np.array([12, 12], np.int32), jax.random.key(0), max_len=64
    )
    both = dec.step(model.params, model.drafter_params, jax.tree.map(jnp.copy, state))
    probe.clear()
    one = dec.step(model.params, model.drafter_params, state.replace(done=jnp.array([False, True])))
    n_moe = model.params["moe"]["mlp"]["router_bias"].shape[0]
    assert probe.loads(n_moe).sum() == n_moe * (sc.tree_size + 1) * k  # the live slot's tree tokens only
    assert int(one.num_emitted[0]) == int(both.num_emitted[0]) and int(one.num_emitted[1]) == 0
    np.testing.assert_array_equal(np.asarray(one.emitted[0]), np.asarray(both.emitted[0]))
    np.testing.assert_array_equal(np.asarray(one.cache.rows[:, 0]), np.asarray(both.cache.rows[:, 0]))
