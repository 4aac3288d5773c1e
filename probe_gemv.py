"""Probe (not product): one GPU share's dense GEMMs at M = 1..8 rows inside a 40-layer scan over stacked weights,
as the model runs them (pad to 8 rows + cuBLAS, ops.COMPILER_OPTIONS) against a fused multiply-reduce GEMV that
reads each layer's slice in place with no padding. Copy into the repo root before a device call:
    python probe_gemv.py --out $OUT/gemv.json          (CPU check: --small)
"""

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, "scripts")
import harness  # noqa: E402

from k26jax import ops  # noqa: E402
from k26jax.model.layers import mm, multiply_reduce  # noqa: E402

F32 = jnp.float32
# (name, K, N, dtype): device 0's dense weights of one TP-8 K2.6 layer
SHAPES = [
    ("q_a", 7168, 1536, jnp.bfloat16),
    ("kv_a", 7168, 576, jnp.bfloat16),
    ("q_b", 1536, 8 * 192, jnp.bfloat16),
    ("o", 8 * 128, 7168, jnp.bfloat16),
    ("shared_gate_up", 7168, 512, jnp.bfloat16),
    ("shared_down", 256, 7168, jnp.bfloat16),
    ("lm_head", 7168, 163840 // 8, jnp.bfloat16),
]


def gemv_reduce(x_MK, w_KN):
    return multiply_reduce("mk,kn->mn", x_MK, w_KN).astype(x_MK.dtype)


def gemm_model(x_MK, w_KN):
    return mm("btk,kn->btn", x_MK[:, None], w_KN)[:, 0]


def run(form, K, N, M, L, dtype, small):
    key = jax.random.key(K + N + M)
    w = (jax.random.normal(key, (L, K, N), F32) * 0.02).astype(dtype)
    x = jax.random.normal(jax.random.key(1), (M, K), F32).astype(jnp.bfloat16)
    f = gemv_reduce if form == "reduce" else gemm_model

    def body(h, w_KN):
        y = f(h, w_KN)  # [M, N]
        return h + 1e-3 * jnp.resize(y, h.shape), None  # a dependence from layer to layer, as in the model

    prog = jax.jit(lambda x, w: jax.lax.scan(body, x, w)[0], compiler_options=ops.COMPILER_OPTIONS)
    if small:
        ref = jnp.einsum("mk,kn->mn", x.astype(F32), w[0].astype(F32))
        assert jnp.allclose(f(x, w[0]).astype(F32), ref, rtol=2e-2, atol=2e-2), form
    reps = harness.time_calls(lambda i: prog(x, w), repeats=5)
    return statistics.median(reps) / L


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--out", default="/tmp/gemv.json")
    args = ap.parse_args()
    ceil = harness.measure_ceilings(small=args.small)
    L = 2 if args.small else 40
    shapes = [(n, max(k // 64, 8), max(m // 64, 8), d) for n, k, m, d in SHAPES] if args.small else SHAPES
    rows = []
    for name, K, N, dtype in shapes:
        floor_us = 1e6 * K * N * jnp.dtype(dtype).itemsize / ceil.copy_bytes_per_s
        for M in args.rows:
            for form in ("model", "reduce"):
                t0 = time.perf_counter()
                us = 1e6 * run(form, K, N, M, L, dtype, args.small)
                rows.append(
                    dict(
                        name=name,
                        K=K,
                        N=N,
                        M=M,
                        form=form,
                        us=us,
                        floor_us=floor_us,
                        pct_floor=100 * floor_us / us,
                        wall_s=time.perf_counter() - t0,
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
    rec = harness.record_header(None, ceilings=ceil.record(), rows=rows)
    harness.write_json(rec, args.out)


if __name__ == "__main__":
    main()
