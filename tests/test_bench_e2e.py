"""scripts/bench_e2e.py: its CPU mesh mode (DDTree greedy == AR greedy on 8 devices, the measurement path),
the controlled accept draw, and the floor / projection accounting."""

import json
import os

import jax
import numpy as np
import pytest

from k26jax import synthetic
from k26jax.config import preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bench(import_script):
    """The script as `python scripts/bench_e2e.py` sees it: scripts/ first on sys.path (it imports `harness`)."""
    return import_script("bench_e2e")


@pytest.fixture(scope="module")
def cpu_record(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "e2e_cpu_mesh8.json"
    rc = bench.main(
        [
            "--cpu-mesh8",
            "--profile",
            str(out.parent / "trace"),
            "--out",
            str(out),
            "--methods",
            "ddtree",
            "--budgets",
            "8",
            "--concurrency",
            "2",
            "--contexts",
            "64",
            "--ablate-at",
            "--half-at",
            "--correctness-modes",
            "ep",
            "--correctness-drafters",
            "oracle",
            "--cpu-new-tokens",
            "12",
        ]
    )
    with open(out) as f:
        return rc, json.load(f), out.parent / "trace"


def test_cpu_mesh8_ddtree_equals_ar_and_measures(cpu_record, bench):
    rc, record, trace = cpu_record
    assert rc == 0
    assert list(trace.rglob("*.xplane.pb")), "--profile wrote no trace"
    checks = [r for r in record["rows"] if r["kind"] == "correctness"]
    assert [r["drafter"] for r in checks] == ["oracle"]
    assert all(r["equal_to_ar"] and r["devices"] == 8 for r in checks)
    assert checks[0]["tau_real"] > 1.5  # the oracle drafter gets multi-token accepts
    step = next(r for r in record["rows"] if r["kind"] == "step")
    assert step["step_ms"] > 0 and 1 <= step["tau_realised"] <= 8
    assert step["pct_of_floor"] == pytest.approx(100 * step["floor_ms"] / step["step_ms"])
    assert step["tok_s"] == pytest.approx(step["tau"] * step["C"] / step["step_ms"] * 1e3)
    tr = step["trace"]  # scripts/trace_report.py on the profiled call: the step's phases and the layers' parts
    assert {"draft", "tree_build", "verify/attention", "verify/moe", "verify/router"} <= set(tr["phases"])
    assert 0 < tr["busy_ms"] <= tr["span_ms"] and tr["launches"] > 0
    router = next(r for r in record["rows"] if r["kind"] == "router")
    assert router["imbalance_balanced"] < router["imbalance_random"]  # the bias balancing evens the loads
    E = 16  # the tiny preset's routed experts; the step's 2 x 9 tokens can touch all of them
    assert 1 <= step["touched_experts"]["mean"] <= E and step["touched_experts"]["calls"] >= 2
    assert 0 < step["touched_uniform"] <= E
    profile = bench.acceptance_profile(bench.parse_args([]), 1024)  # the tiny preset's vocabulary
    assert step["tau"] == pytest.approx(synthetic.expected_tau(profile, "ddtree", 8))  # the calibrated default
    assert "not meaningful" in record["note"]
    assert {"device", "date", "commit", "command", "rows"} <= set(record)


def test_ablation_floors_leave_out_what_they_skip(bench):
    cfg = preset("k26-depth4")
    dcfg = bench.kimi_drafter_config(cfg, tiny=False)
    full = bench.traffic(cfg, dcfg, "ddtree", 32, 8, 8192)
    for phase, parts in bench.SKIPPED_PARTS.items():
        ablated = bench.traffic(cfg, dcfg, "ddtree", 32, 8, 8192, skip=(phase,))
        assert set(full) - set(ablated) == set(parts) and all(ablated[p] == full[p] for p in ablated)
    measured = bench.traffic(cfg, dcfg, "ddtree", 32, 8, 8192, touched=(100.0, 100.0))
    assert measured["routed"][0] == pytest.approx(full["routed"][0] * 100 / bench.experts_touched(264, 384, 8, 1)[0])


def test_synthetic_acceptance_gives_each_method_the_tau_its_tree_earns(bench):
    """Default: chain E[tau] = --tau at b = 8 and DDTree's grows with the budget; --acceptance fixed: one tau."""
    args = bench.parse_args([])
    profile = bench.acceptance_profile(args, 163840)
    chain = bench.method_tau(args, "chain", 7, profile)
    trees = [bench.method_tau(args, "ddtree", b, profile) for b in (8, 32, 128)]
    assert chain == pytest.approx(5.3, abs=1e-3) and chain < trees[0] < trees[1] < trees[2] < 8
    fixed = bench.parse_args(["--acceptance", "fixed", "--tau-chain", "4"])
    assert bench.acceptance_profile(fixed, 163840) is None
    assert [bench.method_tau(fixed, m, 32, None) for m in ("ar", "chain", "ddtree")] == [1.0, 4.0, 5.3]


@pytest.mark.parametrize("tau", [1.0, 2.5, 5.3, 8.0])
def test_accept_draw_has_mean_tau_within_1_to_depth_plus_1(bench, tau):
    lengths = np.asarray(bench.draw_accept_lengths(jax.random.key(3), 20000, 7, tau))
    assert lengths.min() >= 1 and lengths.max() <= 8
    assert abs(lengths.mean() - tau) < 0.03


def test_floor_counts_touched_experts_and_sharding(bench):
    cfg = preset("k26-depth4")
    dcfg = bench.kimi_drafter_config(cfg, tiny=False)
    ar = bench.traffic(cfg, dcfg, "ar", 1, 1, 1024)
    tree = bench.traffic(cfg, dcfg, "ddtree", 64, 10, 8192)
    per_expert = bench.weight_parts(cfg, dcfg, 1, "ep")["routed"][0] / cfg.n_routed_experts
    assert ar["routed"][0] == pytest.approx(8 * per_expert, rel=1e-6)  # one token: its 8 experts
    assert tree["routed"][0] == pytest.approx(cfg.n_routed_experts * per_expert, rel=1e-3)
    assert "drafter" not in ar and tree["draft_lm_head"][0] == tree["lm_head"][0]
    assert ar["kv_cache"][0] == cfg.num_hidden_layers * 1024 * 576 * 2
    ep = bench.traffic(cfg, dcfg, "ddtree", 32, 1, 1024, n=8, expert_mode="ep")
    tp = bench.traffic(cfg, dcfg, "ddtree", 32, 1, 1024, n=8, expert_mode="tp")
    full = bench.traffic(cfg, dcfg, "ddtree", 32, 1, 1024)
    assert tp["routed"][0] == pytest.approx(full["routed"][0] / 8, rel=1e-6)
    assert ep["routed"][0] > tp["routed"][0]  # expert-parallel load imbalance
    assert tp["kv_cache"][0] == full["kv_cache"][0]  # latent cache replicated
    assert tp["lm_head"][0] == pytest.approx(full["lm_head"][0] / 8)


def test_projection_scales_and_adds_collectives(bench):
    record = {
        "ceilings": {"copy_TBps": 4.0, "matmul_bf16_TFLOPs": 620.0},
        "projection_assumptions": {"gpus": 8, "collective_latency_us": 10.0, "nvlink_busbw_GBps": 360.0},
        "rows": [
            {
                "kind": "step",
                "variant": "ddtree32",
                "layers": layers,
                "method": "ddtree",
                "B": 32,
                "C": 1,
                "context": 1024,
                "tau": 5.3,
                "step_ms": ms,
            }
            for layers, ms in ((4, 12.0), (2, 7.0))
        ],
    }
    (row,) = bench.project(record)
    assert row["per_layer_ms"] == pytest.approx(2.5)
    assert row["one_gpu_61_ms"] == pytest.approx(12.0 + 57 * 2.5)
    for mode in ("ep", "tp"):
        p = row[mode]
        assert p["collective_ms"] >= row["collective_count"] * 10e-3
        assert p["step_ms"] == pytest.approx(p["roofline_ms"] / row["eta_1gpu"] + p["collective_ms"])
        assert p["tok_s"] == pytest.approx(5.3 / p["step_ms"] * 1e3)
    assert row["ep"]["step_ms"] > row["tp"]["step_ms"]


def test_large_values_lists_materialised_arrays_only(bench):
    """A slice that a fused dot reads in place (inside a fused computation) is not listed; one copied out is."""
    hlo = """HloModule m

%fused_dot (p0: bf16[4,1024,1024], p1: s32[]) -> bf16[8,1024] {
  %ds = bf16[1,1024,1024]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,1024,1024}
  ROOT %dot = bf16[8,1024]{1,0} dot(%x, %ds)
}

ENTRY %main (w: bf16[4,1024,1024], i: s32[]) -> bf16[8,1024] {
  %w = bf16[4,1024,1024]{2,1,0} parameter(0)
  %copy = bf16[1,1024,1024]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused_copy
  ROOT %out = bf16[8,1024]{1,0} fusion(%w, %i), kind=kCustom, calls=%fused_dot
}
"""
    assert bench.large_values(hlo, 1 << 20) == ["fusion copy bf16[1,1024,1024] 0.00 GB"]
