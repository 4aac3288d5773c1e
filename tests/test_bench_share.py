"""params.shard_table and scripts/bench_share.py: one device's share of the tensor-parallel model, run alone."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from k26jax import sharding
from k26jax.config import preset
from k26jax.model import drafter as drafter_lib
from k26jax.model import params as pt
from k26jax.step_cost import kimi_drafter_config

CFG = preset("tiny")
DCFG = kimi_drafter_config(CFG, tiny=True)


def _global_and_spec(param, stack, mode):
    n = None if stack is None else len(stack.hf_layers)
    return pt.full_shape(param, n), param.spec(mode, stacked=n is not None)


@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_shard_table_is_what_device_0_of_the_mesh_holds(mode):
    mesh = sharding.make_mesh(8)
    for table in (pt.target_table(CFG), pt.drafter_table(DCFG, 8)):
        split = 0
        for (path, p, stack), (lpath, lp, lstack) in zip(pt.walk(table), pt.walk(pt.shard_table(table, 8, mode))):
            assert path == lpath
            shape, spec = _global_and_spec(p, stack, mode)
            local = pt.full_shape(lp, None if lstack is None else len(lstack.hf_layers))
            assert local == NamedSharding(mesh, spec).shard_shape(shape), path
            split += local != shape
        assert split > 5  # heads, vocabulary, MLPs and experts are split


def test_shard_table_refuses_a_split_that_does_not_divide():
    with pytest.raises(ValueError, match="does not split 3 ways"):
        pt.shard_table(pt.target_table(CFG), 3)


def test_share_draft_context_is_the_drafters_on_a_whole_fc(import_script):
    """With fc unsplit (a 1-way share) the share's context K/V is the drafter's own."""
    bench = import_script("bench_share")
    dparams = drafter_lib.init_params(DCFG, 3, jnp.float32)
    features = jax.random.normal(jax.random.key(0), (2, 5, DCFG.context_dim), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    got = bench.ShareDraft().context_kv(dparams, features, positions, dcfg=DCFG)
    want = drafter_lib.context_kv(dparams, DCFG, features, positions)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_share_bench_measures_ar_and_ddtree_with_floors_and_projects_61_layers(import_script, tmp_path):
    bench = import_script("bench_share")
    out = tmp_path / "share.json"
    args = ["--preset", "tiny", "--layers", "3", "2", "--contexts", "128", "256", "--concurrency", "1"]
    assert (
        bench.main(args + ["--steps", "2", "--repeats", "1", "--profile", str(tmp_path / "trace"), "--out", str(out)])
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    steps = [r for r in rows if r["kind"] == "step"]
    # two contexts: each variant's probe step runs on a state of its own shapes
    assert {(r["method"], r["layers"], r["context"]) for r in steps} == {
        (m, n, ctx) for m in ("ar", "ddtree") for n in (3, 2) for ctx in (128, 256)
    }
    local_experts = CFG.n_routed_experts // 8
    for r in steps:
        assert "error" not in r, r.get("error")
        assert r["step_ms"] > 0 and r["floor_ms"] > 0 and r["collective_ms"] > 0
        assert r["projected_step_ms"] == pytest.approx(r["step_ms"] + r["collective_ms"])
        local = r["touched_experts"]["first_shard"]  # device 0's experts that the step's picks fell on
        assert 0 <= local <= local_experts and (local > 0 or r["method"] == "ar")
        assert (r["tau_realised"] > 1) == (r["method"] == "ddtree")
        assert {"verify/attention", "verify/moe", "verify/router"} <= set(r["trace"]["phases"])  # where time goes
    proj = [r for r in rows if r["kind"] == "projection"]
    assert {(r["method"], r["context"], r["layers"], tuple(r["depths"])) for r in proj} == {
        (m, ctx, 61, (2, 3)) for m in ("ar", "ddtree") for ctx in (128, 256)
    }
    assert [r for r in rows if r["kind"] == "router"][0]["imbalance_balanced"] >= 1.0


def test_share_bench_refuses_a_depth_of_dense_layers_only(import_script, capsys):
    with pytest.raises(SystemExit):
        import_script("bench_share").parse_args(["--layers", "20", "1"])
    assert "--layers 1" in capsys.readouterr().err
