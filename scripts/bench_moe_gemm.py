"""Benchmark pallas_kernels.int4_moe_gemm.fused_moe at K2.6 shapes against its memory/compute floor.

  python scripts/bench_moe_gemm.py --out $OUT/moe_gemm_h200.json              (GPU)
  python scripts/bench_moe_gemm.py --quick --out /tmp/moe_gemm_cpu.json       (tiny shapes, interpret mode)

K2.6 MoE layer: 384 experts, top-8, D = 7168, I = 2048, uniform random routing, bf16 activations, both GEMMs and
the routing metadata. Rows per M: the Triton kernels at their default tiling ("triton") and the Mosaic GPU kernels
at the block sizes that matter there ("mosaic_m<block_m>"); `default` marks the wrapper's own choice
(tiling=None). Baselines: XLA unpack-from-int32 + einsum, jnp.int4 + einsum, bf16 ragged_dot.
Floor = max(touched-expert bytes (packed + scales) / copy ceiling, 6*M*k*D*I FLOPs / matmul ceiling), both
ceilings measured in the same run. Every Pallas row is first checked against fused_moe_reference (rel_err).
Timing: a jitted fori_loop of chained calls (each output the next input, routings rotating), median of repeats;
one call's touched weights exceed L2.
"""

import argparse
import functools
import time
import warnings

import harness
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import int4_moe_gemm as moe
from pallas_kernels import int4_moe_mosaic

warnings.filterwarnings("ignore", category=DeprecationWarning, message="The Pallas Triton backend is deprecated")

K26 = dict(num_experts=384, top_k=8, d=7168, i=2048)
QUICK = dict(num_experts=16, top_k=4, d=256, i=256)
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MOSAIC_BLOCKS = {256: (16, 32), 512: (16, 32), 1024: (16, 32, 64), 2048: (32, 64), 4096: (32, 64)}  # else (16,)
BASELINE_MS = (1, 16, 128, 1024)
RAGGED_MS = (1, 16, 128)  # XLA lowers ragged_dot densely here (all experts): larger M runs out of memory


def random_weights(key, num_experts, d, i):
    """Random packed INT4 experts in the kernel layout; scales keep |y| below |x| so chained calls stay finite."""
    k13, k2, ks13, ks2 = jax.random.split(key, 4)
    bits = lambda k, shape: jax.lax.bitcast_convert_type(jax.random.bits(k, shape, jnp.uint32), jnp.int32)
    scale = lambda k, shape, fan_in: (jax.random.uniform(k, shape, minval=0.5, maxval=1.5) / (4 * fan_in**0.5)).astype(
        jnp.bfloat16
    )
    return (
        bits(k13, (num_experts, d // 8, 2, i)),
        scale(ks13, (num_experts, d // 32, 2, i), d),
        bits(k2, (num_experts, i // 8, d)),
        scale(ks2, (num_experts, i // 32, d), i),
    )


def random_routings(key, count, num_tokens, num_experts, top_k):
    """count uniform random routings: ids [count, M, k] (distinct per token), weights [count, M, k] f32."""
    k_ids, k_w = jax.random.split(key)
    scores = jax.random.uniform(k_ids, (count, num_tokens, num_experts))
    ids = jax.lax.top_k(scores, top_k)[1].astype(jnp.int32)
    weights = jax.random.uniform(k_w, (count, num_tokens, top_k), minval=0.1, maxval=0.4)
    return ids, weights


def expert_bytes(d, i):
    """Packed + scale bytes of one expert (gate, up and down)."""
    return (d // 8 * 2 * i + i // 8 * d) * 4 + (d // 32 * 2 * i + i // 32 * d) * 2


def xla_int4_moe(x, topk_ids, topk_weights, w13_int4, w13_scale, w2_int4, w2_scale):
    """Baseline: jnp.int4 weights [E, D, 2I] / [E, I, D], dequantized per expert by XLA, einsum, one-hot combine."""
    weights = topk_weights.astype(jnp.float32)

    def one_expert(y, expert):
        e, w13, s13, w2, s2 = expert
        w13 = (w13.astype(jnp.bfloat16) * jnp.repeat(s13.reshape(s13.shape[0], -1), 32, axis=0)).astype(x.dtype)
        w2 = (w2.astype(jnp.bfloat16) * jnp.repeat(s2, 32, axis=0)).astype(x.dtype)
        gate, up = jnp.split(jnp.dot(x, w13, preferred_element_type=jnp.float32), 2, axis=1)
        out = jnp.dot((jax.nn.silu(gate) * up).astype(x.dtype), w2, preferred_element_type=jnp.float32)
        return y + jnp.sum(jnp.where(topk_ids == e, weights, 0.0), axis=1)[:, None] * out, None

    experts = (jnp.arange(w13_int4.shape[0]), w13_int4, w13_scale, w2_int4, w2_scale)
    return jax.lax.scan(one_expert, jnp.zeros(x.shape, jnp.float32), experts)[0].astype(x.dtype)


def ragged_dot_moe(x, topk_ids, topk_weights, w13_bf16, w2_bf16):
    """Baseline: bf16 experts [E, D, 2I] / [E, I, D] through jax.lax.ragged_dot on the same routing."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = jnp.argsort(flat)
    token = order // top_k
    group_sizes = jnp.bincount(flat, length=w13_bf16.shape[0]).astype(jnp.int32)
    gate_up = jax.lax.ragged_dot(x[token], w13_bf16, group_sizes, preferred_element_type=jnp.float32)
    gate, up = jnp.split(gate_up, 2, axis=1)
    out = jax.lax.ragged_dot(
        (jax.nn.silu(gate) * up).astype(x.dtype), w2_bf16, group_sizes, preferred_element_type=jnp.float32
    )
    out = out * topk_weights.reshape(-1)[order][:, None]
    return jnp.zeros((num_tokens, x.shape[1]), jnp.float32).at[token].add(out).astype(x.dtype)


def chained_loop(moe_fn, num_iters):
    """jit(x, ids [R, M, k], weights [R, M, k], *experts) running num_iters chained calls, routing i % R."""

    def run(x, ids, weights, *experts):
        def body(it, x):
            r = it % ids.shape[0]
            return moe_fn(x, ids[r], weights[r], *experts)

        return jax.lax.fori_loop(0, num_iters, body, x, unroll=min(num_iters, 4))

    return jax.jit(run)


def cases_for(m, shapes, interpret, x_dtype):
    """[(name, kind, fn, is the wrapper's default)] of the Pallas rows at M = m."""
    d, i, top_k = shapes["d"], shapes["i"], shapes["top_k"]
    wrapper_block_m = moe.mosaic_block_m(m, x_dtype, d, i, interpret)
    triton = moe.fit_tiling(moe.choose_tiling(m, top_k, x_dtype, interpret), d, i)
    cases = [("triton", "pallas", functools.partial(moe.fused_moe, tiling=triton, interpret=interpret), False)]
    if not wrapper_block_m:
        return [(name, kind, fn, True) for name, kind, fn, _ in cases]
    for block_m in sorted({*MOSAIC_BLOCKS.get(m, (16,)), wrapper_block_m}):
        fn = functools.partial(int4_moe_mosaic.fused_moe_mosaic, block_m=block_m)
        cases.append((f"mosaic_m{block_m}", "mosaic", fn, block_m == wrapper_block_m))
    return cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_record_args(parser, "bench/results/moe_gemm.json")
    parser.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU smoke run)")
    parser.add_argument("--ms", default=None, help="comma-separated M sweep")
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=400.0, help="start no new case after this many s")
    args = parser.parse_args()
    start = time.perf_counter()
    shapes, interpret = (QUICK, True) if args.quick else (K26, False)
    num_experts, top_k, d, i = shapes["num_experts"], shapes["top_k"], shapes["d"], shapes["i"]
    sweep = tuple(int(m) for m in args.ms.split(",")) if args.ms else ((1, 4, 32) if args.quick else SWEEP)
    ceilings = harness.measure_ceilings(small=args.quick)
    record = harness.record_header(args.commit, shapes=shapes, ceilings=ceilings.record(), rows=[])
    print(f"ceilings: {ceilings.record()}", flush=True)

    key = jax.random.key(0)
    experts = random_weights(key, num_experts, d, i)
    routings, cases = {}, []  # cases: (name, kind, M, fn, operands, default)
    for m in sweep:
        ids, weights = random_routings(jax.random.fold_in(key, m), 4, m, num_experts, top_k)
        x = jax.random.normal(jax.random.fold_in(key, 10_000 + m), (m, d), jnp.float32)
        routings[m] = (x if args.quick else x.astype(jnp.bfloat16), ids, weights)
        for name, kind, fn, default in cases_for(m, shapes, interpret, routings[m][0].dtype):
            cases.append((name, kind, m, fn, experts, default))
    if not args.no_baselines:
        k4a, k4b, kba, kbb = jax.random.split(jax.random.fold_in(key, 7), 4)
        int4 = (
            jax.random.randint(k4a, (num_experts, d, 2 * i), -8, 8, jnp.int8).astype(jnp.int4),
            experts[1],
            jax.random.randint(k4b, (num_experts, i, d), -8, 8, jnp.int8).astype(jnp.int4),
            experts[3],
        )
        for m in routings if args.quick else [m for m in BASELINE_MS if m in routings]:
            cases.append(("xla_unpack_int32_einsum", "baseline", m, moe.fused_moe_reference, experts, False))
            cases.append(("xla_jnp_int4_einsum", "baseline", m, xla_int4_moe, int4, False))

    def floor_of(m):
        touched = np.mean([len(np.unique(r)) for r in np.asarray(routings[m][1])])
        nbytes, flops = touched * expert_bytes(d, i), 6.0 * m * top_k * d * i
        return nbytes, flops, ceilings.floor_s(nbytes, flops)

    def iters_for(kind, m):
        if args.quick or kind == "baseline":  # baselines scan all experts: milliseconds per call at any M
            return 2 if args.quick else 3
        return int(np.clip(np.ceil(0.03 / floor_of(m)[2]), 3, 200))

    def compile_case(case):
        name, kind, m, fn, operands, _ = case
        x, ids, weights = routings[m]
        loop = chained_loop(fn, iters_for(kind, m)).lower(x, ids, weights, *operands).compile()
        single = jax.jit(fn).lower(x, ids[0], weights[0], *operands).compile() if kind != "baseline" else None
        return loop, single

    references = {}

    def measure(case, compiled):
        name, kind, m, fn, operands, default = case
        nbytes, flops, floor = floor_of(m)
        row = {"name": name, "kind": kind, "M": m, "default": default, "touched_bytes": nbytes, "flops": flops}
        row["floor_s"] = floor
        if isinstance(compiled, Exception):  # a kernel that does not compile at a shape is a result
            row["error"] = harness.error_text(compiled)
        else:
            loop, single = compiled
            x, ids, weights = routings[m]
            if single is not None:
                if m not in references:
                    references[m] = jax.jit(moe.fused_moe_reference)(x, ids[0], weights[0], *experts)
                y = single(x, ids[0], weights[0], *operands)
                row["rel_err_vs_reference"] = harness.relative_error(y, references[m])
                row["finite"] = bool(np.isfinite(np.asarray(y, np.float32)).all())
            n = iters_for(kind, m)
            seconds = harness.median_seconds(
                harness.rotating(loop, [(x, ids, weights, *operands)]), calls=1, per_call=n, repeats=args.repeats
            )
            row.update(
                time_s=seconds,
                us_per_token=seconds / m * 1e6,
                pct_of_floor=100 * floor / seconds,
                effective_tb_per_s=nbytes / seconds / 1e12,
            )
        record["rows"].append(row)
        harness.write_json(record, args.out)
        print(row, flush=True)

    compiled = harness.compile_all(
        {n: functools.partial(compile_case, case) for n, case in enumerate(cases)}, workers=1 if args.quick else 12
    )
    print(f"compiled {len(cases)} cases in {time.perf_counter() - start:.0f} s", flush=True)
    for n, case in enumerate(cases):
        if time.perf_counter() - start > args.budget_s:
            print(f"budget spent, skipping {case[0]} M={case[2]}", flush=True)
            continue
        measure(case, compiled[n])
    if not args.no_baselines:  # last and one at a time: XLA autotunes these dense dots on copies of the weights
        del int4
        bf16 = (
            jax.random.normal(kba, (num_experts, d, 2 * i), jnp.bfloat16) * 0.01,
            jax.random.normal(kbb, (num_experts, i, d), jnp.bfloat16) * 0.01,
        )
        for m in routings if args.quick else [m for m in RAGGED_MS if m in routings]:
            if time.perf_counter() - start > args.budget_s:
                break
            case = ("ragged_dot_bf16", "baseline", m, ragged_dot_moe, bf16, False)
            measure(case, harness.compile_all({0: functools.partial(compile_case, case)}, workers=1)[0])

    print(
        f"\n{'M':>5} {'case (* = default)':<24} {'time us':>9} {'floor us':>9} {'% floor':>8} {'us/tok':>8} {'err':>8}"
    )
    for row in record["rows"]:
        if "error" in row:
            print(f"{row['M']:>5} {row['name']:<24} ERROR {row['error'][:90]}")
            continue
        err = row.get("rel_err_vs_reference")
        print(
            f"{row['M']:>5} {row['name'] + (' *' if row['default'] else ''):<24} {row['time_s'] * 1e6:>9.1f} "
            f"{row['floor_s'] * 1e6:>9.1f} {row['pct_of_floor']:>8.1f} {row['us_per_token']:>8.2f} "
            f"{'' if err is None else f'{err:.1e}':>8}"
        )


if __name__ == "__main__":
    main()
