"""Benchmark tree_mla_attention on the GPU against its roofline floor and a naive XLA version.

  python scripts/bench_verify_attn.py --out $OUT/verify_attn_h200.json
  python scripts/bench_verify_attn.py --layer-scan --out $OUT/verify_attn_layer_scan_h200.json

Sweep (default): the wrapper's default kernels (Mosaic prefix where T*H > 16, Triton 16-row tiles for 8-head
decode; --prefix-kernel forces one) at prefix / batch / T / heads shapes, with the naive XLA version where its
scores fit. Floor = max(latent-cache bytes / 4.0 TB/s, FLOPs / 620 TFLOP/s) (DESIGN.md's figures),
FLOPs = 2*C*T*H*(S + visible tail)*(R+P+R); `pct_of_measured_floor` uses the ceilings measured in the same run.
Calls rotate over independent input sets (> 2x L2 together where memory allows).

--layer-scan: each shape as the model runs it, inside a `lax.scan` over an L-layer cache stack with `layer=` (each
layer's output the next one's q_lat), against the same call alone on layer l of that stack (l rotating). A call
alone pays its dispatch from the host, which the scan pays once for L layers, so small shapes get their in-model
cost. L: enough layers for 2x L2 of cache, 8 to 64, the stack at most 8 GiB; 3 rounds alternating the two forms.
"""

import argparse
import functools
import math
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np

from k26jax import ddtree
from pallas_kernels.mla_splits import sequence_groups
from pallas_kernels.tree_mla_attention import PREFIX_KERNELS, mosaic_plan, tree_mla_attention

R, P = 512, 64
SCALE = 0.1
NAIVE_MAX_SCORE_BYTES = 24 << 30
MAX_STACK_BYTES = 8 << 30

SWEEP = [  # (C, S, T, H, with naive XLA), most important first
    (8, 32768, 65, 64, True),
    (8, 32768, 1, 64, True),
    (8, 32768, 33, 64, True),
    (1, 8192, 65, 64, True),
    (8, 8192, 65, 64, True),
    (8, 32768, 65, 8, True),
    (8, 32768, 1, 8, True),
    (8, 65536, 1, 64, True),
    (1, 65536, 33, 64, True),
    (16, 4096, 33, 64, True),
    (8, 8192, 129, 64, True),
    (16, 32768, 1, 64, False),
    (8, 8192, 1, 64, True),
    (1, 32768, 1, 64, True),
    (1, 32768, 65, 64, False),
    (8, 1024, 65, 64, True),
    (8, 1024, 1, 64, False),
    (1, 1024, 1, 64, True),
    (1, 1024, 65, 64, False),
    (1, 8192, 1, 64, False),
    (1, 8192, 33, 64, False),
    (8, 8192, 33, 8, False),
    (8, 8192, 1, 8, False),
    (1, 32768, 65, 8, False),
    (1, 32768, 1, 8, False),
    (16, 8192, 129, 8, False),
    (1, 8192, 65, 8, False),
    (8, 1024, 65, 8, False),
    (1, 1024, 1, 8, False),
    (8, 32768, 33, 8, False),
]


# ---- inputs and floors -----------------------------------------------------------------------------------------
def random_tree_visibility(rng, C, T):
    """[C, T, T] ancestor-or-self relation of random trees with parents[i] < i (node 0 is the root)."""
    parents = [[-1] + [int(rng.integers(0, i)) for i in range(1, T)] for _ in range(C)]
    return np.stack([ddtree.visibility_from_parents(p) for p in parents])


def make_operands(C, S, T, H, seed=0, layers=None):
    """bf16 (q_lat, q_rope, cache [C, S, R+P] or stack [layers, C, S, R+P], prefix_len = S, tail, visibility); the
    trees are the same for every seed, so the sets of one shape have the same FLOPs."""
    k = jax.random.split(jax.random.key(seed), 4)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16)
    cache_shape = (C, S, R + P) if layers is None else (layers, C, S, R + P)
    return (
        normal(k[0], (C, T, H, R)),
        normal(k[1], (C, T, H, P)),
        normal(k[2], cache_shape),
        jnp.full((C,), S, jnp.int32),
        normal(k[3], (C, T, R + P)),
        jnp.asarray(random_tree_visibility(np.random.default_rng(0), C, T)),
    )


def abstract_operands(C, S, T, H, layers=None):
    return [
        jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.eval_shape(lambda: make_operands(C, S, T, H, 0, layers))
    ]


def num_input_sets(C, S, T, H):
    return harness.num_sets(2 * (C * S * (R + P) + C * T * H * (R + P) + C * T * (R + P)))


def floors(C, S, T, H, visibility, ceilings: harness.Ceilings):
    """(cache bytes, FLOPs, floor at DESIGN.md's figures, floor at the measured ceilings)."""
    cache_bytes = C * S * (R + P) * 2
    flops = 2 * (C * T * H * S + H * int(np.asarray(visibility).sum())) * (R + P + R)
    design = max(cache_bytes / harness.DESIGN_COPY_BYTES_PER_S, flops / harness.DESIGN_MATMUL_FLOPS)
    return cache_bytes, flops, design, ceilings.floor_s(cache_bytes, flops)


def naive_xla(q_lat, q_rope, cache, prefix_len, tail, visibility, *, scale):
    """Baseline: bf16 einsums over the whole cache and the tail, masked float32 softmax."""
    f32 = jnp.float32

    def scores(keys):
        s = jnp.einsum("cthr,csr->cths", q_lat, keys[..., :R], preferred_element_type=f32)
        return (s + jnp.einsum("cthp,csp->cths", q_rope, keys[..., R:], preferred_element_type=f32)) * scale

    S = cache.shape[1]
    visible = jnp.concatenate(
        [jnp.broadcast_to((jnp.arange(S) < prefix_len[:, None])[:, None], (*visibility.shape[:2], S)), visibility],
        axis=-1,
    )[:, :, None, :]
    p = jax.nn.softmax(jnp.where(visible, jnp.concatenate([scores(cache), scores(tail)], -1), -jnp.inf), axis=-1)
    p = p.astype(q_lat.dtype)
    o = jnp.einsum("cths,csr->cthr", p[..., :S], cache[..., :R], preferred_element_type=f32)
    return (o + jnp.einsum("cths,csr->cthr", p[..., S:], tail[..., :R], preferred_element_type=f32)).astype(q_lat.dtype)


def naive_fits(C, S, T, H):
    return C * T * H * (S + T) * 6 <= NAIVE_MAX_SCORE_BYTES


# ---- the sweep ---------------------------------------------------------------------------------------------------
def compile_sweep_point(point, args):
    """(the attention, the naive XLA version or None), compiled for one shape."""
    attention = functools.partial(tree_mla_attention, scale=SCALE, prefix_kernel=args.prefix_kernel)
    kernel = jax.jit(attention).lower(*abstract_operands(*point)).compile()
    with_naive = args.points or point in {s[:4] for s in SWEEP if s[4]}
    if not (with_naive and naive_fits(*point)):
        return kernel, None
    return kernel, jax.jit(functools.partial(naive_xla, scale=SCALE)).lower(*abstract_operands(*point)).compile()


def sweep_row(point, compiled, ceilings, args):
    (kernel, naive), (C, S, T, H) = compiled, point
    arg_sets = [make_operands(*point, seed=i) for i in range(num_input_sets(*point))]
    cache_bytes, flops, floor, measured_floor = floors(*point, arg_sets[0][5], ceilings)
    row = dict(C=C, prefix=S, T=T, H=H, cache_bytes=cache_bytes, flops=flops, floor_s=floor)
    row["measured_floor_s"] = measured_floor
    if args.prefix_kernel != "triton" and T * H > 16:  # the Mosaic kernel's split plan: groups of each sequence
        plan = mosaic_plan(C, T * H, S, T)
        row.update(groups=len(plan), groups_per_seq=[len(g) for g in sequence_groups(plan, C)])
    sec = harness.median_seconds(harness.rotating(kernel, arg_sets), min_calls=len(arg_sets))
    row.update(
        time_s=sec,
        pct_of_floor=100 * floor / sec,
        pct_of_measured_floor=100 * measured_floor / sec,
        tflops=flops / sec / 1e12,
    )
    if naive is not None:
        row["naive_xla_s"] = harness.median_seconds(harness.rotating(naive, arg_sets[:2]), target_s=0.03, repeats=3)
        row["speedup_vs_naive"] = row["naive_xla_s"] / sec
    return row


def sweep_line(row):
    naive = f"{row['naive_xla_s'] * 1e3:9.3f} {row['speedup_vs_naive']:6.2f}x" if "naive_xla_s" in row else ""
    return (
        f"{row['time_s'] * 1e3:9.3f} {row['floor_s'] * 1e3:9.3f} {row['pct_of_floor']:6.1f}% {row['tflops']:7.1f} "
        f"{naive}"
    )


# ---- the layer scan -------------------------------------------------------------------------------------------
def num_layers(C, S):
    layer_bytes = C * S * (R + P) * 2
    return int(min(64, MAX_STACK_BYTES // layer_bytes, max(8, math.ceil(2 * harness.L2_BYTES / layer_bytes))))


def call_alone(q_lat, q_rope, stack, prefix_len, tail, visibility, layer):
    return tree_mla_attention(q_lat, q_rope, stack, prefix_len, tail, visibility, scale=SCALE, layer=layer)


def layer_scan(q_lat, q_rope, stack, prefix_len, tail, visibility):
    """The last layer's output of the chain over every layer of the stack."""

    def body(q, layer):
        return call_alone(q, q_rope, stack, prefix_len, tail, visibility, layer), None

    return jax.lax.scan(body, q_lat, jnp.arange(stack.shape[0], dtype=jnp.int32))[0]


def compile_layer_point(point, args):
    """(the call alone with a layer index, the layer scan), compiled for one shape."""
    operands = abstract_operands(*point, layers=num_layers(point[0], point[1]))
    return (
        jax.jit(call_alone).lower(*operands, jax.ShapeDtypeStruct((), jnp.int32)).compile(),
        jax.jit(layer_scan).lower(*operands).compile(),
    )


def layer_scan_row(point, compiled, ceilings, args):
    alone, scan = compiled
    operands = make_operands(*point, layers=num_layers(point[0], point[1]))
    L = operands[2].shape[0]
    chained = operands[0]
    for layer in range(L):  # the scan should equal its layers called one by one
        chained = alone(chained, *operands[1:], jnp.int32(layer))
    identical = bool(jnp.array_equal(chained, scan(*operands)))
    alone_sets = [(*operands, jnp.int32(layer)) for layer in range(L)]
    rounds = {"alone": [], "scan": []}
    for r in range(3):
        for name in ("alone", "scan") if r % 2 == 0 else ("scan", "alone"):
            if name == "alone":
                sec = harness.median_seconds(harness.rotating(alone, alone_sets), min_calls=L)
            else:
                sec = harness.median_seconds(lambda i: scan(*operands), per_call=L)
            rounds[name].append(sec)
    C, S, T, H = point
    cache_bytes, flops, floor, _ = floors(*point, operands[5], ceilings)
    row = dict(C=C, prefix=S, T=T, H=H, layers=L, identical_to_calls_alone=identical, floor_s=floor)
    for name, secs in rounds.items():
        sec = float(np.median(secs))
        row.update({f"{name}_s": sec, f"{name}_rounds_s": secs, f"{name}_pct_of_floor": 100 * floor / sec})
    return row


def layer_scan_line(row):
    return (
        f"{row['layers']:>2} {row['alone_s'] * 1e6:9.1f} {row['alone_pct_of_floor']:6.1f}% {row['scan_s'] * 1e6:14.1f} "
        f"{row['scan_pct_of_floor']:6.1f}%  {row['identical_to_calls_alone']}"
    )


MODES = {  # (compile a shape, measure it, the printed header after "C prefix T H", a printed row)
    "sweep": (compile_sweep_point, sweep_row, "  time_ms  floor_ms  %floor  TFLOP/s  naive_ms speedup", sweep_line),
    "layer_scan": (
        compile_layer_point,
        layer_scan_row,
        " L  alone_us  %floor   scan_us/layer  %floor  identical",
        layer_scan_line,
    ),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_record_args(parser, "bench/results/verify_attn.json")
    parser.add_argument("--layer-scan", action="store_true", help="each shape inside the model's layer scan")
    parser.add_argument("--points", nargs="+", help="C,S,T,H shapes (default: the sweep)")
    parser.add_argument("--prefix-kernel", default="auto", choices=PREFIX_KERNELS, help="sweep: force a kernel")
    parser.add_argument("--budget-s", type=float, default=250.0, help="start no new shape after this")
    args = parser.parse_args()
    start = time.perf_counter()
    points = [tuple(int(x) for x in p.split(",")) for p in args.points] if args.points else [p[:4] for p in SWEEP]
    ceilings = harness.measure_ceilings()
    record = harness.record_header(
        args.commit,
        jax=jax.__version__,
        ceilings=ceilings.record(),
        floor_model=dict(
            copy_TBps=harness.DESIGN_COPY_BYTES_PER_S / 1e12, matmul_TFLOPs=harness.DESIGN_MATMUL_FLOPS / 1e12
        ),
        rows=[],
        skipped=[],
    )
    print(f"ceilings: {ceilings.record()}", flush=True)
    compile_point, measure, header, line = MODES["layer_scan" if args.layer_scan else "sweep"]
    compiled = harness.compile_all({p: functools.partial(compile_point, p, args) for p in points})
    print(
        f"compiled {len(points)} shapes [{time.perf_counter() - start:.0f}s]\n  C prefix    T   H {header}", flush=True
    )
    for point in points:
        if time.perf_counter() - start > args.budget_s:
            record["skipped"].append(point)
            continue
        head = f"{point[0]:>3} {point[1]:>6} {point[2]:>4} {point[3]:>3}"
        if isinstance(compiled[point], Exception):
            record["rows"].append(
                dict(zip(("C", "prefix", "T", "H"), point), error=harness.error_text(compiled[point]))
            )
            print(f"{head}  ERROR {record['rows'][-1]['error'][:100]}", flush=True)
            continue
        record["rows"].append(measure(point, compiled[point], ceilings, args))
        harness.write_json(record, args.out)
        print(f"{head} {line(record['rows'][-1])}", flush=True)
    harness.write_json(record, args.out)
    print("skipped:", record["skipped"])


if __name__ == "__main__":
    main()
