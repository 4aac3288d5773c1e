"""The model through ops' Pallas paths (interpret mode) equals the reference paths, on 1 device and under
shard_map on the 8-device mesh (experts EP and TP, heads split)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k26jax import api, ops, sharding
from k26jax.config import preset
from k26jax.model import target

PALLAS = dict(moe="pallas", attention="pallas", tree_build="pallas", tree_accept="pallas", interpret=True)


def verify_logits(cfg, params, impls):
    """A 5-node tree tail over a 4-row cache prefix."""
    ids = jnp.array([[3, 5, 7, 9, 11]])
    positions = jnp.array([[4, 5, 5, 6, 6]])
    parents = np.array([-1, 0, 0, 1, 2])
    vis = np.eye(5, dtype=bool)
    for i in range(1, 5):
        vis[i] |= vis[parents[i]]
    rows = jax.random.normal(jax.random.key(0), (cfg.num_hidden_layers, 1, 16, cfg.latent_dim))
    fn = jax.jit(
        lambda p: target.forward_tail(p, cfg, ids, positions, rows, jnp.array([4]), jnp.asarray(vis)[None], impls)[0]
    )
    return np.asarray(fn(params), np.float64)


@pytest.mark.parametrize("mode", [None, "ep", "tp"])
def test_pallas_paths_match_reference(mode):
    # TP splits the expert intermediate 8 ways; the kernel's down GEMM needs >= 16 packed words (128 rows) a shard.
    cfg = preset("tiny").replace(moe_intermediate_size=1024) if mode == "tp" else preset("tiny")
    params = target.init_params(cfg, seed=0, dtype=jnp.float32)
    ref = verify_logits(cfg, params, ops.Impls())
    if mode is None:
        got = verify_logits(cfg, params, ops.Impls(**PALLAS))
    else:
        mesh = sharding.make_mesh(8)
        got = verify_logits(cfg, api.place(params, cfg, mesh, mode), ops.Impls(**PALLAS, mesh=mesh, expert_mode=mode))
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5
