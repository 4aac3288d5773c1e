"""The model through ops' Pallas paths (interpret mode) equals the reference paths, on 1 device and under
shard_map on the 8-device mesh (experts EP and TP, heads split); ops' ablation and XLA doors; pallas_kernels'
import graph."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k26jax import api, ops, sharding
from k26jax.config import preset
from k26jax.model import target

PALLAS = dict(moe="pallas", attention="pallas", tree_build="pallas", tree_accept="pallas", dense_rows=8, interpret=True)


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


def test_without_the_dense_kernel_every_dot_takes_the_scans_own_slice(monkeypatch):
    """A layer's weight matrix reaches a cuBLAS dot as the scan's own slice (offset by the scan's counter, which
    XLA's dynamic-slice fusion reads in place), not sliced again at the layer index (which made the H100's AR
    step 17% slower)."""
    cfg = preset("tiny")
    params = target.init_params(cfg, seed=0, dtype=jnp.float32)
    got, real = [], ops.LayerWeight.get
    monkeypatch.setattr(ops.LayerWeight, "get", lambda self: got.append(self.sliced is not None) or real(self))
    verify_logits(cfg, params, ops.Impls())
    assert got and all(got), got


def test_skip_returns_the_input_without_a_kernel():
    """Benchmark phase ablations: moe="skip" returns x_ND and attention="skip" q_lat, whatever the other arguments
    (None here: a kernel or reference would fail on them)."""
    impls = ops.Impls(moe="skip", attention="skip")
    x = jnp.arange(12.0).reshape(3, 4)
    assert ops.moe_gemm(x, None, None, None, None, None, None, layer=0, impls=impls) is x
    q_lat = jnp.ones((1, 2, 4, 8))
    assert ops.mla_attention(q_lat, None, None, None, None, None, scale=1.0, layer=0, impls=impls) is q_lat
    with pytest.raises(ValueError, match="tree_build"):
        ops.Impls(tree_build="skip")


def test_draft_topk_and_visibility_through_ops():
    logits = jax.random.normal(jax.random.key(1), (2, 3, 50))
    logq, ids = ops.draft_topk(logits, 4)
    want_logq, want_ids = jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), 4)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(logq, want_logq, rtol=1e-6, atol=1e-6)
    parents = [[-1, 0, 0, 1, 3], [-1, 0, 1, -1, -1]]  # the second tree is padded after 3 rows
    want = np.eye(5, dtype=bool)[None].repeat(2, axis=0)
    for c, tree in enumerate(parents):
        for i in range(5):
            j = i
            while tree[j] >= 0:  # each row sees its ancestors
                j = tree[j]
                want[c, i, j] = True
    np.testing.assert_array_equal(ops.visibility_from_parents(jnp.array(parents), max_depth=3), want)


def test_pallas_kernels_import_no_cycle_and_no_k26jax():
    """pallas_kernels holds single-device kernels only: its modules import each other without a cycle and never
    import k26jax (data flows one way, model <- ops <- pallas_kernels)."""
    root = pathlib.Path(__file__).parents[1] / "pallas_kernels"
    modules = {path.stem: path for path in root.glob("*.py")}
    deps = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        assert not any(n.split(".")[0] == "k26jax" for n in imported), name
        deps[name] = {n.split(".")[1] for n in imported if n.startswith("pallas_kernels.")} & set(modules) - {name}
    done = set()
    while len(done) < len(deps):  # peel modules whose imports are all peeled; a cycle leaves none to peel
        ready = {name for name in deps if name not in done and deps[name] <= done}
        assert ready, f"import cycle among {sorted(set(deps) - done)}"
        done |= ready
