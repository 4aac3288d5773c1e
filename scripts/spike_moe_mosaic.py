"""GPU spike for pallas_kernels/int4_moe_mosaic: correctness at real D/I with few experts, then the two
kernels timed alone at K2.6 shapes (384 experts, top-8) against the Triton default, M = 512 / 1024."""
import collections
import functools
import glob
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import int4_moe_gemm as moe
from pallas_kernels import int4_moe_mosaic as mm
from scripts import bench_moe_gemm as bench


def timed(fn, *args, iters=10):
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            out = compiled(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / iters)
    return float(np.median(times))


def main():
    out = sys.argv[1]
    key = jax.random.PRNGKey(0)
    rows = []
    d, i = 7168, 2048
    experts = bench.random_weights(key, 8, d, i)
    for m, bm in ((1, 16), (17, 16), (64, 32), (300, 64)):
        ids, wts = (a[0] for a in bench.random_routings(jax.random.fold_in(key, m), 1, m, 8, 4))
        x = jax.random.normal(jax.random.fold_in(key, 7 + m), (m, d), jnp.float32).astype(jnp.bfloat16)
        y = jax.jit(functools.partial(mm.fused_moe_mosaic, block_m=bm))(x, ids, wts, *experts)  # in flight 1
        y_ref = jax.jit(moe.fused_moe_reference)(x, ids, wts, *experts)
        row = dict(check="small", M=m, block_m=bm, rel_err=bench.rel_err(y, y_ref),
                   finite=bool(np.isfinite(np.asarray(y, np.float32)).all()))
        rows.append(row)
        print(json.dumps(row), flush=True)
    json.dump(rows, open(out, "w"), indent=1)
    experts = bench.random_weights(key, 384, d, i)
    copy_bw = bench.copy_ceiling(8 << 30, 3)
    print(f"copy {copy_bw / 1e12:.3f} TB/s", flush=True)
    for m, bm in ((512, 16), (1024, 32)):
        ids, wts = (a[0] for a in bench.random_routings(jax.random.fold_in(key, m), 1, m, 384, 8))
        x = jax.random.normal(jax.random.fold_in(key, 7 + m), (m, d), jnp.float32).astype(jnp.bfloat16)
        touched = len(np.unique(np.asarray(ids)))
        floor = touched * bench.expert_bytes(d, i) / copy_bw
        tiling = moe.fit_tiling(moe.choose_tiling(m, 8), d, i)
        y_tr = jax.jit(functools.partial(moe.fused_moe, tiling=tiling))(x, ids, wts, *experts)
        row = dict(check="timing", M=m, block_m=bm, floor_us=floor * 1e6,
                   triton_us=timed(functools.partial(moe.fused_moe, tiling=tiling), x, ids, wts, *experts) * 1e6)
        route = moe.sort_routing(ids.reshape(-1), 384, bm)
        nb = jnp.sum(route.block_expert >= 0, dtype=jnp.int32)[None]
        slot_row = jnp.arange(route.block_expert.shape[0], dtype=jnp.int32) * bm

        def gather(x, ids):
            route = moe.sort_routing(ids.reshape(-1), 384, bm)
            token = jnp.maximum(route.slot_pair, 0) // 8
            return jnp.where(route.slot_pair[:, None] >= 0, mm.to_p1_order(x)[token], 0)

        xs = jax.jit(gather)(x, ids)  # slot order (padded): the kernels alone, as before
        row["glue_route_gather_us"] = timed(gather, x, ids) * 1e6
        for depth in ((0, 1) if m == 1024 else (1,)):
            fn = functools.partial(mm.fused_moe_mosaic, block_m=bm, wgmma_in_flight=depth)
            y_mo = jax.jit(fn)(x, ids, wts, *experts)
            common = dict(block_m=bm, num_sms=mm.default_num_sms(), wgmma_in_flight=depth, interpret=False)
            gate_up = functools.partial(mm._grouped_gemm, gate_up=True, **common,
                                        out_type=jax.ShapeDtypeStruct((xs.shape[0], i), jnp.bfloat16))
            down = functools.partial(mm._grouped_gemm, out_type=jax.ShapeDtypeStruct((m * 8, d), jnp.float32),
                                     gate_up=False, **common)
            h = jax.jit(gate_up)(nb, route.block_expert, slot_row, route.slot_pair, xs, *experts[:2])
            h_perm = h  # gate_up writes h in P1 order
            y_pairs = jax.jit(down)(nb, route.block_expert, slot_row, route.slot_pair, h_perm, *experts[2:])
            t_mo = timed(fn, x, ids, wts, *experts)
            y_parts = (y_pairs * wts.reshape(-1, 1)).reshape(m, 8, d).sum(1).astype(jnp.bfloat16)
            row[f"d{depth}"] = dict(rel_err_parts_vs_triton=bench.rel_err(y_parts, y_tr),
                mosaic_us=t_mo * 1e6, pct_mosaic=100 * floor / t_mo, rel_err_vs_triton=bench.rel_err(y_mo, y_tr),
                finite=bool(np.isfinite(np.asarray(y_mo, np.float32)).all()),
                gate_up_us=timed(gate_up, nb, route.block_expert, slot_row, route.slot_pair, xs, *experts[:2]) * 1e6,
                down_us=timed(down, nb, route.block_expert, slot_row, route.slot_pair, h_perm, *experts[2:]) * 1e6)
        row["glue_permute_h_us"] = timed(mm.to_p1_order, h) * 1e6
        row["glue_combine_us"] = timed(lambda y, w: (y * w.reshape(-1, 1)).reshape(m, 8, d).sum(1).astype(jnp.bfloat16),
                                       y_pairs, wts) * 1e6
        row.update(pct_triton=100 * floor * 1e6 / row["triton_us"], gate_up_floor_us=floor * 2 / 3 * 1e6,
                   down_floor_us=floor / 3 * 1e6, used_blocks=int(nb[0]))
        rows.append(row)
        print(json.dumps(row), flush=True)
        json.dump(rows, open(out, "w"), indent=1)


def profile(out_dir, m=1024, bm=32, ranges=96):
    """Mosaic's profiler on both kernels at M = m: per warpgroup, the time in each named scope over the first
    `ranges` ranges (bounds-checked), and their span."""
    d, i = 7168, 2048
    key = jax.random.PRNGKey(1)
    experts = bench.random_weights(key, 384, d, i)
    ids, wts = (a[0] for a in bench.random_routings(key, 1, m, 384, 8))
    x = jax.random.normal(key, (m, d), jnp.float32).astype(jnp.bfloat16)
    params = mm.plgpu.CompilerParams
    mm.SMEM_BYTES -= 3 * ranges * 16
    summary = {}
    for kernel in ("gate_up", "down"):
        prof_dir = os.path.join(out_dir, f"prof_{kernel}")
        os.makedirs(prof_dir, exist_ok=True)
        mm.plgpu.CompilerParams = functools.partial(params, profile_space=ranges, profile_dir=prof_dir,
                                                    profile_bounds_check=True)
        route = moe.sort_routing(ids.reshape(-1), 384, bm)
        nb = jnp.sum(route.block_expert >= 0, dtype=jnp.int32)[None]
        slot_row = jnp.arange(route.block_expert.shape[0], dtype=jnp.int32) * bm
        token = jnp.maximum(route.slot_pair, 0) // 8
        xs = jnp.where(route.slot_pair[:, None] >= 0, mm.to_p1_order(x)[token], 0)
        common = dict(block_m=bm, num_sms=mm.default_num_sms(), wgmma_in_flight=1, interpret=False)
        if kernel == "gate_up":
            out = jax.ShapeDtypeStruct((xs.shape[0], i), jnp.bfloat16)
            args = (nb, route.block_expert, slot_row, route.slot_pair, xs, *experts[:2])
        else:
            out = jax.ShapeDtypeStruct((m * 8, d), jnp.float32)
            args = (nb, route.block_expert, slot_row, route.slot_pair, xs[:, :i], *experts[2:])
        jax.block_until_ready(jax.jit(functools.partial(mm._grouped_gemm, out_type=out, gate_up=kernel == "gate_up",
                                                        **common))(*args))
        mm.plgpu.CompilerParams = params
        per_scope = collections.defaultdict(list)
        spans = []
        for path in glob.glob(os.path.join(prof_dir, "*")):
            events = json.load(open(path))["traceEvents"]
            open_at, by_tid = {}, collections.defaultdict(lambda: collections.defaultdict(float))
            first, last = {}, {}
            for ev in events:
                key_ = (ev["tid"], ev["name"])
                first.setdefault(ev["tid"], ev["ts"])
                last[ev["tid"]] = ev["ts"]
                if ev["ph"] == "B":
                    open_at[key_] = ev["ts"]
                else:
                    by_tid[ev["tid"]][ev["name"]] += ev["ts"] - open_at.pop(key_)
            for tid, scopes in by_tid.items():
                spans.append(last[tid] - first[tid])
                for name, us in scopes.items():
                    per_scope[name].append(us)
        summary[kernel] = dict(files=len(glob.glob(os.path.join(prof_dir, "*"))), mean_span_us=float(np.mean(spans)),
                               mean_us={k: float(np.mean(v)) for k, v in per_scope.items()},
                               count={k: len(v) for k, v in per_scope.items()})
        print(kernel, json.dumps(summary[kernel]), flush=True)
    json.dump(summary, open(os.path.join(out_dir, "profile.json"), "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--profile":
        profile(sys.argv[2])
    else:
        main()
