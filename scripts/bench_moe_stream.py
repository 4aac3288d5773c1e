"""Ablation for the INT4 MoE GEMM: how fast can a Pallas-Triton kernel only *stream* the touched gate/up weights?

Same routing (`sort_routing`, 16-row blocks), same grid and launch order (N tiles fastest) and the same
[32 words, 64 columns] K steps as `int4_moe_gemm`'s gate_up kernel, but no dequant and no MMA: each program
sums its packed tiles (as bf16 values, through a dot so the loads are pipelined) and stores one row.
Two layouts are streamed:
  * "checkpoint": w13_packed [E, D/8, 2, I] as on disk, so a K step reads 64 pieces of 256 B, 16 KB apart;
  * "tile_major": the same words re-laid out [E, D/8/32, I/64, 2, 32, 64], so a K step reads 16 KB in one piece.
Bandwidth over the copy ceiling of the same run says whether the access pattern (a converter re-layout would
fix it) or the in-kernel work (dequant, MMA) keeps the real kernel near 70-80% of its floor (bench/moe_gemm.md).

GPU:  PYTHONPATH=. python3 scripts/bench_moe_stream.py --out bench/results/moe_stream_h200.json
CPU:  PYTHONPATH=. .venv/bin/python scripts/bench_moe_stream.py --quick   (tiny shapes, interpret mode)
"""

import argparse
import datetime
import functools
import json
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import int4_moe_gemm as moe
from scripts import bench_moe_gemm as bench

warnings.filterwarnings("ignore", category=DeprecationWarning, message="The Pallas Triton backend is deprecated")

_TILING = moe.choose_tiling(16, 8)  # the real kernel's blocks at 16-row blocks
BLOCK_M, BLOCK_KW, BLOCK_N = _TILING.block_m, _TILING.block_kw_gate_up, _TILING.block_n_gate_up


def to_tile_major(w13_packed):
    """[E, D/8, 2, I] -> [E, D/8/kw, I/n, 2, kw, n]: each (expert, K step, N tile) slab contiguous."""
    e, words, _, i = w13_packed.shape
    tiles = w13_packed.reshape(e, words // BLOCK_KW, BLOCK_KW, 2, i // BLOCK_N, BLOCK_N)
    return tiles.transpose(0, 1, 4, 3, 2, 5)


def _stream_kernel(block_expert_ref, w_ref, out_ref, *, num_experts, tile_major):
    """Program (N tile n, row block b): column sums of the low bytes of gate ^ up over b's expert, N tile n
    (exact in bf16 and float32, so the checksum is exact on any backend).

    The tiles feed a dot (ones @ tile), so Triton pipelines their loads with cp.async as in the real kernel;
    the only other work is an XOR, an AND and an int -> bf16 convert a word
    (the real kernel: ~16 instructions a word)."""
    n, b = pl.program_id(0), pl.program_id(1)
    expert = block_expert_ref[b]

    @pl.when((expert >= 0) & (expert < num_experts))
    def _():
        ones = jnp.ones((BLOCK_M, BLOCK_KW), jnp.bfloat16)

        def k_step(step, acc):
            if tile_major:
                gate, up = w_ref[expert, step, n, 0], w_ref[expert, step, n, 1]
            else:
                rows, cols = pl.ds(step * BLOCK_KW, BLOCK_KW), pl.ds(n * BLOCK_N, BLOCK_N)
                gate, up = w_ref[expert, rows, 0, cols], w_ref[expert, rows, 1, cols]
            return acc + jnp.dot(ones, ((gate ^ up) & 0xFF).astype(jnp.bfloat16), preferred_element_type=jnp.float32)

        steps = w_ref.shape[1] if tile_major else w_ref.shape[1] // BLOCK_KW
        acc = jax.lax.fori_loop(0, steps, k_step, jnp.zeros((BLOCK_M, BLOCK_N), jnp.float32))
        plgpu.store(out_ref.at[b, pl.ds(n * BLOCK_N, BLOCK_N)], acc.max(axis=0))  # its rows are equal


def stream(weights, topk_ids, *, tile_major, interpret=False):
    """Column sums of the touched gate ^ up words, per row block -> [blocks, I] float32."""
    num_experts = weights.shape[0]
    route = moe.sort_routing(topk_ids.reshape(-1).astype(jnp.int32), num_experts, BLOCK_M)
    num_blocks = route.block_expert.shape[0]
    i = weights.shape[2] * BLOCK_N if tile_major else weights.shape[-1]
    return pl.pallas_call(
        functools.partial(_stream_kernel, num_experts=num_experts, tile_major=tile_major),
        out_shape=jax.ShapeDtypeStruct((num_blocks, i), jnp.float32),
        grid=(i // BLOCK_N, num_blocks),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name="moe_stream",
    )(route.block_expert, weights)


def stream_reference(w13_packed, topk_ids):
    """{expert: [I] float64} column sums of (gate ^ up) & 0xFF for each touched expert."""
    words = np.asarray(w13_packed)
    out = {}
    for e in np.unique(np.asarray(topk_ids)):
        if e < words.shape[0]:
            out[int(e)] = (np.bitwise_xor(words[e, :, 0], words[e, :, 1]) & 0xFF).astype(np.float64).sum(axis=0)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU check)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--ms", default="16,256,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    num_experts, top_k, d, i = (16, 4, 512, 256) if args.quick else (384, 8, 7168, 2048)
    key = jax.random.PRNGKey(0)
    w13 = jax.lax.bitcast_convert_type(jax.random.bits(key, (num_experts, d // 8, 2, i), jnp.uint32), jnp.int32)
    layouts = {"checkpoint": w13, "tile_major": jax.block_until_ready(to_tile_major(w13))}
    copy_bw = bench.copy_ceiling((1 << 24) if args.quick else (8 << 30), args.repeats)
    record = dict(
        device=jax.devices()[0].device_kind,
        commit=args.commit,
        command=" ".join(["python3", *sys.argv]),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        copy_bytes_per_s=copy_bw,
        rows=[],
    )
    print(f"copy ceiling {copy_bw / 1e12:.3f} TB/s", flush=True)
    for m in (int(v) for v in args.ms.split(",")):
        ids = bench.random_routings(jax.random.fold_in(key, m), 4, m, num_experts, top_k)[0]
        touched = np.mean([len(np.unique(r)) for r in np.asarray(ids)])
        nbytes = touched * (d // 8) * 2 * i * 4
        expected = stream_reference(w13, ids[0])
        for name, weights in layouts.items():
            fn = functools.partial(stream, tile_major=name == "tile_major", interpret=args.quick)
            route = moe.sort_routing(ids[0].reshape(-1), num_experts, BLOCK_M)
            got = np.asarray(jax.jit(fn)(weights, ids[0]))
            ok = all(
                np.array_equal(got[b], expected[int(e)]) for b, e in enumerate(np.asarray(route.block_expert)) if e >= 0
            )
            num_iters = 2 if args.quick else 20
            loop = jax.jit(
                lambda w, ids: jax.lax.fori_loop(
                    0, num_iters, lambda it, acc: acc + fn(w, ids[it % ids.shape[0]])[0, 0], jnp.float32(0)
                )
            )
            seconds = bench.median_seconds(loop.lower(weights, ids).compile(), (weights, ids), num_iters, args.repeats)
            row = dict(
                M=m,
                layout=name,
                time_s=seconds,
                touched_bytes=nbytes,
                checksum_ok=bool(ok),
                tb_per_s=nbytes / seconds / 1e12,
                pct_of_copy=100 * nbytes / seconds / copy_bw,
            )
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        json.dump(record, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
