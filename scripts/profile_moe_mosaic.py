"""Where the time of pallas_kernels/int4_moe_mosaic goes, at K2.6 shapes (384 experts, top-8) on the GPU.

For each M: the wrapper against the Triton default, each kernel alone (gate_up, down) on the wrapper's own
inputs, the XLA parts (pair ranks, operands, combine), and the floors (gate_up streams 2/3 of the touched
bytes, down 1/3). With --profile: Mosaic's profiler over the first `--ranges` named-scope ranges of every
warpgroup (kernel named scopes: the memory warpgroup's `wait_empty`, the compute warpgroups' `wait_full` and
`epilogue`), summed per warpgroup.

GPU:  PYTHONPATH=. python3 scripts/profile_moe_mosaic.py --out $OUT/moe_mosaic_parts.json --commit SHA [--profile]
"""

import argparse
import collections
import datetime
import functools
import glob
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import int4_moe_gemm as moe
from pallas_kernels import int4_moe_mosaic as mosaic
from scripts import bench_moe_gemm as bench

D, I, E, TOP_K = 7168, 2048, 384, 8


def median_seconds(fn, *args, calls=20):
    """Median over 5 repeats of the seconds a call of `calls` dispatched back to back (so the GPU, not the host's
    dispatch, sets the pace)."""
    compiled = jax.jit(fn).lower(*args).compile()
    return bench.median_seconds(lambda *a: [compiled(*a) for _ in range(calls)], args, calls, 5)


def kernel_inputs(x, ids, block_m):
    """The two kernels' operands as fused_moe_mosaic builds them (h for down: zeros of its shape)."""
    ops = mosaic.routed_operands(x, ids.reshape(-1), E, block_m, TOP_K)
    h = jnp.zeros((ops.slot_row.shape[0] * block_m, I), jnp.bfloat16)
    return (
        (ops.num_blocks, ops.block_expert, ops.x_row, ops.block_rows, ops.xs),
        (ops.num_blocks, ops.block_expert, ops.slot_row, ops.block_rows, h),
    )


def glue_us(x, ids, weights, block_m):
    """Median us of the XLA parts of the wrapper: the pair ranks, all operands (ranks, x gather) and the
    combine."""
    local_ids = ids.reshape(-1).astype(jnp.int32)
    ops = mosaic.routed_operands(x, local_ids, E, block_m, TOP_K)
    y_slots = jax.random.normal(jax.random.PRNGKey(1), (ops.slot_row.shape[0] * block_m, D), jnp.bfloat16)
    return dict(
        ranks_us=median_seconds(functools.partial(moe.expert_ranks, num_experts=E), local_ids) * 1e6,
        operands_us=median_seconds(
            functools.partial(mosaic.routed_operands, num_experts=E, block_m=block_m, top_k=TOP_K), x, local_ids
        )
        * 1e6,
        combine_us=median_seconds(mosaic.combine, y_slots, ops.pair_slot.reshape(ids.shape), weights) * 1e6,
    )


def kernels(block_m):
    common = dict(
        block_m=block_m, widths=mosaic.wgmma_widths(block_m), num_sms=mosaic.default_num_sms(), interpret=False
    )

    def gate_up(num_blocks, block_expert, rows, block_rows, xs, w, s):
        out = jax.ShapeDtypeStruct((block_expert.shape[0] * block_m, I), jnp.bfloat16)
        return mosaic._grouped_gemm(num_blocks, block_expert, rows, block_rows, xs, w, s, out, gate_up=True, **common)

    def down(num_blocks, block_expert, rows, block_rows, h, w, s):
        out = jax.ShapeDtypeStruct((h.shape[0], D), jnp.bfloat16)  # the wrapper's bf16 pair rows
        return mosaic._grouped_gemm(num_blocks, block_expert, rows, block_rows, h, w, s, out, gate_up=False, **common)

    return gate_up, down


def summarize_traces(prof_dir):
    """Per named scope: the mean over warpgroups of the time each spent in it; and the mean traced span."""
    per_scope, spans = collections.defaultdict(list), []
    for path in glob.glob(os.path.join(prof_dir, "*.json")):
        opened, totals, first, last = {}, collections.defaultdict(lambda: collections.defaultdict(float)), {}, {}
        for event in json.load(open(path))["traceEvents"]:
            tid, name = event["tid"], event["name"]
            first.setdefault(tid, event["ts"])
            last[tid] = event["ts"]
            if event["ph"] == "B":
                opened[tid, name] = event["ts"]
            else:
                totals[tid][name] += event["ts"] - opened.pop((tid, name))
        for tid, scopes in totals.items():
            spans.append(last[tid] - first[tid])
            for name, us in scopes.items():
                per_scope[name].append(us)
    return dict(
        mean_span_us=float(np.mean(spans)), mean_us_per_warpgroup={k: float(np.mean(v)) for k, v in per_scope.items()}
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ms", default="512,1024")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--ranges", type=int, default=96)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    key = jax.random.PRNGKey(0)
    experts = bench.random_weights(key, E, D, I)
    copy_bw = bench.copy_ceiling(8 << 30, 3)
    record = dict(
        device=jax.devices()[0].device_kind,
        commit=args.commit,
        command=" ".join(["python3", *sys.argv]),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        copy_bytes_per_s=copy_bw,
        rows=[],
    )
    for m in (int(v) for v in args.ms.split(",")):
        block_m = 16 if m <= 512 else 32
        ids, weights = (a[0] for a in bench.random_routings(jax.random.fold_in(key, m), 1, m, E, TOP_K))
        x = jax.random.normal(jax.random.fold_in(key, m + 7), (m, D), jnp.float32).astype(jnp.bfloat16)
        floor = len(np.unique(np.asarray(ids))) * bench.expert_bytes(D, I) / copy_bw
        gate_up_args, down_args = kernel_inputs(x, ids, block_m)
        gate_up, down = kernels(block_m)
        tiling = moe.fit_tiling(moe.choose_tiling(m, TOP_K), D, I)
        row = dict(
            M=m,
            block_m=block_m,
            floor_us=floor * 1e6,
            triton_us=median_seconds(functools.partial(moe.fused_moe, tiling=tiling), x, ids, weights, *experts) * 1e6,
            mosaic_us=median_seconds(
                functools.partial(mosaic.fused_moe_mosaic, block_m=block_m), x, ids, weights, *experts
            )
            * 1e6,
            gate_up_us=median_seconds(gate_up, *gate_up_args, *experts[:2]) * 1e6,
            gate_up_floor_us=floor * 2 / 3 * 1e6,
            down_us=median_seconds(down, *down_args, *experts[2:]) * 1e6,
            down_floor_us=floor / 3 * 1e6,
            **glue_us(x, ids, weights, block_m),
        )
        if args.profile:
            params = mosaic.plgpu.CompilerParams
            mosaic.SMEM_BYTES -= 3 * args.ranges * 16  # the profiler's buffers
            fresh = kernels(block_m)  # new functions: jit would reuse the unprofiled traces of the timed ones
            for name, fn, operands in (
                ("gate_up", fresh[0], gate_up_args + experts[:2]),
                ("down", fresh[1], down_args + experts[2:]),
            ):
                prof_dir = os.path.join(os.path.dirname(args.out) or ".", f"profile_{name}_m{m}")
                os.makedirs(prof_dir, exist_ok=True)
                mosaic.plgpu.CompilerParams = functools.partial(
                    params, profile_space=args.ranges, profile_dir=prof_dir, profile_bounds_check=True
                )
                jax.block_until_ready(jax.jit(fn)(*operands))
                mosaic.plgpu.CompilerParams = params
                row[f"profile_{name}"] = summarize_traces(prof_dir)
            mosaic.SMEM_BYTES += 3 * args.ranges * 16
        record["rows"].append(row)
        print(json.dumps(row), flush=True)
        json.dump(record, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
