"""Does a layer loop over stacked bf16 weights copy each layer's weights out before its matmuls? (GPU, not a test)

  PYTHONPATH=. python3 scripts/bench_stack_slice.py --out bench/results/stack_slice_h200.json

An MLP-like chain x += (x @ w1[l]) @ w2[l] over L layers, M rows, run as: a lax.scan over the stacks (the
model's form), a Python loop over static slices of the stacks, a Python loop over separate per-layer arrays,
and the scan under XLA options that might fuse the slice into the matmul (ops.SLICE_IN_PLACE is the one the
engine uses from 8 rows on). Reports the median time per layer,
the weight bytes per layer over the copy rate measured in the same run, and the large arrays the compiled
HLO materialises (a copied layer shows as one of w1's or w2's shape).
"""

import argparse
import datetime
import json
import subprocess
import sys

import jax
import jax.numpy as jnp

from k26jax import ops
from scripts.bench_e2e import _median_call_s, ceilings, large_values

SCAN_OPTIONS = {
    "scan": None,
    "scan+dynamic_slice_fusion": {"xla_gpu_enable_dynamic_slice_fusion": True},
    "scan+SLICE_IN_PLACE": ops.SLICE_IN_PLACE,  # dynamic-slice fusion + cuBLAS dots
    "scan+triton_gemm_any": {"xla_gpu_triton_gemm_any": True},
}


def layer(x, w1, w2):
    h = jnp.dot(x, w1, preferred_element_type=jnp.float32).astype(x.dtype)
    return x + (jnp.dot(h, w2, preferred_element_type=jnp.float32) * 1e-3).astype(x.dtype)


def scanned(x, w1s, w2s):
    return jax.lax.scan(lambda x, w: (layer(x, *w), None), x, (w1s, w2s))[0]


def static_slices(x, w1s, w2s):
    for i in range(w1s.shape[0]):
        x = layer(x, w1s[i], w2s[i])
    return x


def per_layer(x, w1_list, w2_list):
    for w1, w2 in zip(w1_list, w2_list):
        x = layer(x, w1, w2)
    return x


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dims", type=int, nargs=2, default=(7168, 4096), help="K N: w1 [K,N], w2 [N,K]")
    parser.add_argument("--rows", type=int, nargs="+", default=(1, 8, 256))
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per timed repeat")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    commit = (
        args.commit
        or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    L, (K, N) = args.layers, args.dims
    ceiling = ceilings(small=jax.default_backend() == "cpu")
    rate = ceiling["copy_TBps"] * 1e12
    record = {
        "device": jax.devices()[0].device_kind,
        "commit": commit or "unknown",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3"] + sys.argv),
        "layers": L,
        "K": K,
        "N": N,
        "ceilings": ceiling,
        "rows": [],
    }
    print(f"copy rate {rate / 1e12:.2f} TB/s", flush=True)
    keys = jax.random.split(jax.random.key(0), 3)
    w1s = jax.random.normal(keys[0], (L, K, N), jnp.bfloat16) * K**-0.5
    w2s = jax.random.normal(keys[1], (L, N, K), jnp.bfloat16) * N**-0.5
    w1_list, w2_list = [w1s[i] for i in range(L)], [w2s[i] for i in range(L)]
    layer_bytes = 2 * 2 * K * N
    for M in args.rows:
        x = jax.random.normal(keys[2], (M, K), jnp.bfloat16)
        variants = {
            name: (jax.jit(scanned).lower(x, w1s, w2s).compile(options), (x, w1s, w2s))
            for name, options in SCAN_OPTIONS.items()
        }
        variants["static_slices"] = (jax.jit(static_slices).lower(x, w1s, w2s).compile(), (x, w1s, w2s))
        variants["per_layer_arrays"] = (jax.jit(per_layer).lower(x, w1_list, w2_list).compile(), (x, w1_list, w2_list))
        expected = variants["per_layer_arrays"][0](*variants["per_layer_arrays"][1])
        for name, (compiled, operands) in variants.items():
            seconds = _median_call_s(lambda _: compiled(*operands), args.calls)
            out = compiled(*operands)
            row = {
                "variant": name,
                "M": M,
                "ms_per_layer": seconds / L * 1e3,
                "weights_floor_ms_per_layer": layer_bytes / rate * 1e3,
                "pct_of_floor": 100 * layer_bytes / rate / (seconds / L),
                "max_abs_diff_vs_per_layer": float(
                    jnp.max(jnp.abs(out.astype(jnp.float32) - expected.astype(jnp.float32)))
                ),
                "large_values": large_values(compiled.as_text(), 2 * K * N),
            }
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
