"""tree_mla_attention per layer as the model runs it (GPU): inside a `lax.scan` over an L-layer cache stack with
`layer=`, each layer's output the next one's q_lat, against the same call alone (layer l of the same stack, l
rotating), at the sweep's shapes. A call alone costs at least its dispatch from the host (~40-60 us here), which
the scan pays once for L layers, so the small shapes get an in-model figure.

  PYTHONPATH=. python3 scripts/bench_attn_layer_scan.py --out $OUT/layer_scan.json --commit SHA [--points C,S,T,H ...]

L: enough layers for 2x L2 of cache in the stack, 8 to 64, the stack at most 8 GiB. Timing: back-to-back calls
between two syncs (`seconds_per_call`), 3 rounds alternating the two forms, medians; the scan's divided by L.
"""

import argparse
import concurrent.futures
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tree_mla_attention import tree_mla_attention
from scripts.bench_verify_attn import (
    L2_BYTES,
    SCALE,
    SWEEP,
    P,
    R,
    new_record,
    random_tree_visibility,
    roofline,
    seconds_per_call,
)

MAX_STACK_BYTES = 8 << 30


def num_layers(C, S):
    layer_bytes = C * S * (R + P) * 2
    return int(min(64, MAX_STACK_BYTES // layer_bytes, max(8, math.ceil(2 * L2_BYTES / layer_bytes))))


def call_alone(q_lat, q_rope, stack, prefix_len, tail, visibility, layer):
    return tree_mla_attention(q_lat, q_rope, stack, prefix_len, tail, visibility, scale=SCALE, layer=layer)


def layer_scan(q_lat, q_rope, stack, prefix_len, tail, visibility):
    """The last layer's output of the chain over every layer of the stack."""

    def body(q, layer):
        return call_alone(q, q_rope, stack, prefix_len, tail, visibility, layer), None

    return jax.lax.scan(body, q_lat, jnp.arange(stack.shape[0], dtype=jnp.int32))[0]


def abstract_operands(C, S, T, H):
    bf16, L = jnp.bfloat16, num_layers(C, S)
    shapes = [
        ((C, T, H, R), bf16),
        ((C, T, H, P), bf16),
        ((L, C, S, R + P), bf16),
        ((C,), jnp.int32),
        ((C, T, R + P), bf16),
        ((C, T, T), jnp.bool_),
    ]
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]


def compile_point(point):
    operands = abstract_operands(*point)
    return (
        jax.jit(call_alone).lower(*operands, jax.ShapeDtypeStruct((), jnp.int32)).compile(),
        jax.jit(layer_scan).lower(*operands).compile(),
    )


def operands_for(point, seed=0):
    C, S, T, H = point
    k = jax.random.split(jax.random.key(seed), 4)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16)
    return (
        normal(k[0], (C, T, H, R)),
        normal(k[1], (C, T, H, P)),
        normal(k[2], (num_layers(C, S), C, S, R + P)),
        jnp.full((C,), S, jnp.int32),
        normal(k[3], (C, T, R + P)),
        jnp.asarray(random_tree_visibility(np.random.default_rng(seed), C, T)),
    )


def time_point(point, compiled, ceilings):
    alone, scan = compiled
    operands = operands_for(point)
    L = operands[2].shape[0]
    chained = operands[0]
    for layer in range(L):  # the scan must equal its layers called one by one
        chained = alone(chained, *operands[1:], jnp.int32(layer))
    identical = bool(jnp.array_equal(chained, scan(*operands)))
    alone_sets = [(*operands, jnp.int32(layer)) for layer in range(L)]
    times = {"alone": [], "scan": []}
    for r in range(3):
        for name in ("alone", "scan") if r % 2 == 0 else ("scan", "alone"):
            sec = seconds_per_call(alone, alone_sets) if name == "alone" else seconds_per_call(scan, [operands]) / L
            times[name].append(sec)
    C, S, T, H = point
    cache_bytes, flops, floor, _ = roofline(C, S, T, H, operands[5], ceilings)
    row = dict(
        C=C,
        prefix=S,
        T=T,
        H=H,
        layers=L,
        identical_to_calls_alone=identical,
        cache_bytes=cache_bytes,
        flops=flops,
        floor_s=floor,
    )
    for name, secs in times.items():
        sec = float(np.median(secs))
        row.update({f"{name}_s": sec, f"{name}_rounds_s": secs, f"{name}_pct_of_floor": 100 * floor / sec})
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--points", nargs="+", help="C,S,T,H shapes (default: bench_verify_attn's sweep)")
    parser.add_argument("--budget_s", type=float, default=400.0, help="stop starting new points after this")
    args = parser.parse_args()
    start = time.perf_counter()
    points = (
        [tuple(int(x) for x in p.split(",")) for p in args.points] if args.points else [tuple(p[:4]) for p in SWEEP]
    )
    record, ceilings = new_record(args.commit, rows=[], skipped=[])
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        compiled = dict(zip(points, pool.map(compile_point, points)))
    print(f"compiled {len(points)} points [{time.perf_counter() - start:.0f}s]", flush=True)
    print("  C prefix    T   H  L  alone_us  %floor   scan_us/layer  %floor  identical", flush=True)
    for point in points:
        if time.perf_counter() - start > args.budget_s:
            record["skipped"].append(point)
            continue
        row = time_point(point, compiled[point], ceilings)
        record["rows"].append(row)
        print(
            f"{point[0]:>3} {point[1]:>6} {point[2]:>4} {point[3]:>3} {row['layers']:>2} {row['alone_s'] * 1e6:9.1f} "
            f"{row['alone_pct_of_floor']:6.1f}% {row['scan_s'] * 1e6:14.1f} {row['scan_pct_of_floor']:6.1f}%  "
            f"{row['identical_to_calls_alone']}",
            flush=True,
        )
        json.dump(record, open(args.out, "w"), indent=1)
    json.dump(record, open(args.out, "w"), indent=1)
    print("skipped:", record["skipped"])


if __name__ == "__main__":
    main()
