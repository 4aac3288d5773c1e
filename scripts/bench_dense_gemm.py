"""Benchmark a layer scan's few-row dense dots: pallas_kernels.few_row_gemm against XLA's cuBLAS dot, at the dense
shapes of one TP-8 K2.6 layer, against the bytes floor.

  python scripts/bench_dense_gemm.py --out $OUT/dense_gemm.json       (GPU)
  python scripts/bench_dense_gemm.py --quick --out /tmp/dense.json    (tiny shapes, interpret mode: a smoke run)

Each row times a jitted lax.scan over a stack of --layers bf16 weights (together beyond L2) in which every layer
multiplies the same x [M, K] through layers.mm and an ops.LayerWeight, as the model's layer scan does: "cublas"
with Impls.dense_rows = 0 (padded rows, the scan's slice read in place), "kernel" with dense_rows = 64, and
"kernel_p<n>" the kernel planned for about n programs (--programs, a race of the split count). Time per dot =
the scan's median time / layers. Floor = the weight's bytes / the copy ceiling measured in the same run. Every
kernel row is first checked against the float64 product (rel_err).
"""

import argparse
import sys
import warnings

import harness
import jax
import jax.numpy as jnp
import numpy as np

from k26jax import ops
from k26jax.model import layers as L
from pallas_kernels import few_row_gemm

warnings.filterwarnings("ignore", category=DeprecationWarning, message="The Pallas Triton backend is deprecated")

SHAPES = {  # one TP-8 share of a K2.6 layer: name -> (K, N)
    "q_a": (7168, 1536),
    "q_b": (1536, 1536),
    "kv_a": (7168, 576),
    "o": (1024, 7168),
    "shared_gate_up": (7168, 512),
    "shared_down": (256, 7168),
    "router": (7168, 384),
}
QUICK = {"a": (256, 96), "b": (96, 384)}
ROWS = (1, 4, 8, 16, 33, 64)


def scan_fn(layers: int, dense_rows: int, interpret: bool, programs=None, unroll=1):
    impls = ops.Impls(dense_rows=dense_rows, interpret=interpret)

    def run(x_MK, w_LKN):
        def body(_, xs):
            layer, w_KN = xs  # as the model's scan: the stack's slice by the scan itself, and the layer index
            if programs:
                return None, few_row_gemm.few_row_gemm(x_MK, w_LKN, layer=layer, programs=programs, interpret=interpret)
            return None, L.mm("btk,kn->btn", x_MK[:, None], ops.LayerWeight(w_LKN, layer, impls, w_KN))[:, 0]

        return jax.lax.scan(body, None, (jnp.arange(layers, dtype=jnp.int32), w_LKN), unroll=unroll)[1]

    return jax.jit(run, compiler_options=ops.COMPILER_OPTIONS if jax.default_backend() == "gpu" else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--layers", type=int, default=40, help="weights in a stack (default 40)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--unroll", type=int, default=1, help="layers a scan iteration (amortises the loop's own cost)")
    ap.add_argument("--programs", type=int, nargs="*", default=[], help="also race the kernel planned for ~n programs")
    ap.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU smoke run)")
    harness.add_record_args(ap, "bench/results/dense_gemm.json")
    args = ap.parse_args(argv)
    if (
        min(args.rows) < 1
        or max(args.rows) > few_row_gemm.MAX_ROWS
        or args.layers < 1
        or min(args.programs, default=1) < 1
    ):
        ap.error(f"--rows must be in 1..{few_row_gemm.MAX_ROWS}, --layers and --programs >= 1")
    shapes = QUICK if args.quick else SHAPES
    ceil = harness.measure_ceilings(small=args.quick)
    record = harness.record_header(args.commit, layers=args.layers, unroll=args.unroll, ceilings=ceil.record(), rows=[])
    variants = {"cublas": 0, "kernel": few_row_gemm.MAX_ROWS}
    for name, (K, N) in shapes.items():
        w = jax.random.normal(jax.random.key(K + N), (args.layers, K, N), jnp.float32) / np.sqrt(K)
        w = w.astype(jnp.bfloat16)
        for M in args.rows:
            x = jax.random.normal(jax.random.key(M), (M, K), jnp.float32).astype(jnp.bfloat16)
            floor_s = ceil.floor_s(K * N * 2, 2 * M * K * N)
            row = {
                "weight": name,
                "K": K,
                "N": N,
                "M": M,
                "floor_us": 1e6 * floor_s,
                "plan": few_row_gemm.plan(M, K, N),
            }
            fns = {v: scan_fn(args.layers, rows, args.quick, unroll=args.unroll) for v, rows in variants.items()}
            fns |= {f"kernel_p{n}": scan_fn(args.layers, 0, args.quick, n, args.unroll) for n in args.programs}
            row["plans"] = {n: few_row_gemm.plan(M, K, N, n) for n in args.programs}
            want = np.asarray(x, np.float64) @ np.asarray(w[-1], np.float64)
            for v, fn in fns.items():
                row[f"{v}_rel_err"] = harness.relative_error(fn(x, w)[-1], want)
            for _ in range(2):  # alternate the variants: equal drift
                for v, fn in fns.items():
                    s = harness.median_seconds(lambda i: fn(x, w), repeats=args.repeats) / args.layers
                    row.setdefault(f"{v}_us", []).append(1e6 * s)
            for v in fns:
                row[f"{v}_us"] = min(row[f"{v}_us"])
                row[f"{v}_pct_of_floor"] = 100 * row["floor_us"] / row[f"{v}_us"]
            row["kernel_speedup"] = row["cublas_us"] / row["kernel_us"]
            races = " ".join(f"p{n} {row[f'kernel_p{n}_us']:.2f}" for n in args.programs)
            record["rows"].append(row)
            print(
                f"[{name} M={M}] floor {row['floor_us']:.2f} us | cuBLAS {row['cublas_us']:.2f} us "
                f"({row['cublas_pct_of_floor']:.0f}%) | kernel {row['kernel_us']:.2f} us "
                f"({row['kernel_pct_of_floor']:.0f}%, rel_err {row['kernel_rel_err']:.1e}) "
                f"| x{row['kernel_speedup']:.2f} {races}",
                flush=True,
            )
            harness.write_json(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
