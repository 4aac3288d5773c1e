"""Benchmark tree_mla_attention (Pallas-Triton) against its roofline floor and a naive XLA version (GPU).

  PYTHONPATH=. python3 scripts/bench_verify_attn.py --out bench/results/verify_attn_h200.json

1. GPU correctness checks (bf16 kernel vs float32 reference).
2. Tune: each tile candidate on one shape per regime (verify T > 1, decode T = 1 with 64 heads, decode
   under TP-8), checked against the reference; the fastest becomes that regime's knobs.
3. Sweep prefix / batch / T / heads with the chosen knobs, with the naive XLA version where it fits.
Floor = max(latent-cache bytes / 4.0 TB/s, FLOPs / 620 TFLOP/s), FLOPs = 2*C*T*H*(S + visible tail)*(R+P+R);
pct_of_measured_floor uses the copy and bf16 matmul ceilings measured in the same run. Timing: back-to-back
calls rotating over independent input sets (> 2x L2 in total where memory allows), median of repeats.
"""

import argparse
import concurrent.futures
import datetime
import functools
import json
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from k26jax import ddtree
from pallas_kernels.mla_prefix_mosaic import sequence_groups
from pallas_kernels.tree_mla_attention import mosaic_plan, tree_mla_attention, tree_mla_attention_reference

R, P = 512, 64
HBM_BYTES_PER_S, MMA_FLOPS_PER_S = 4.0e12, 620e12
L2_BYTES = 60 << 20
SCALE = 0.1
NAIVE_MAX_SCORE_BYTES = 24 << 30


def random_tree_visibility(rng, C, T):
    """[C, T, T] ancestor-or-self relation of random trees with parents[i] < i (node 0 is the root)."""
    parents = [[-1] + [int(rng.integers(0, i)) for i in range(1, T)] for _ in range(C)]
    return np.stack([ddtree.visibility_from_parents(p) for p in parents])


def make_input_sets(C, S, T, H, num_sets, seed=0, prefix_len=None):
    """num_sets independent bf16 argument tuples (q_lat, q_rope, cache, prefix_len, tail, visibility)."""
    rng = np.random.default_rng(seed)
    visibility = jnp.asarray(random_tree_visibility(rng, C, T))
    prefix_len = jnp.full((C,), S, jnp.int32) if prefix_len is None else jnp.asarray(prefix_len, jnp.int32)
    sets = []
    for i in range(num_sets):
        k = jax.random.split(jax.random.key(seed * 1000 + i), 4)
        normal = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16)
        sets.append(
            (
                normal(k[0], (C, T, H, R)),
                normal(k[1], (C, T, H, P)),
                normal(k[2], (C, S, R + P)),
                prefix_len,
                normal(k[3], (C, T, R + P)),
                visibility,
            )
        )
    return sets


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


def seconds_per_call(compiled, arg_sets, target_s=0.05, repeats=5):
    """Median over repeats of back-to-back calls (rotating over arg_sets) between two block_until_ready."""
    jax.block_until_ready(compiled(*arg_sets[0]))
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*arg_sets[-1]))
    calls = int(min(500, max(len(arg_sets), target_s / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            out = compiled(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def abstract_args(C, S, T, H):
    bf16 = jnp.bfloat16
    shapes = [
        ((C, T, H, R), bf16),
        ((C, T, H, P), bf16),
        ((C, S, R + P), bf16),
        ((C,), jnp.int32),
        ((C, T, R + P), bf16),
        ((C, T, T), jnp.bool_),
    ]
    return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]


def compile_all(jobs):
    """jobs: {key: (fn, point)} -> {key: compiled executable or the exception}, compiled in parallel threads."""

    def build(fn, point):
        try:
            return jax.jit(fn).lower(*abstract_args(*point)).compile()
        except Exception as e:  # a tile that does not fit (shared memory, registers) is a result
            return e

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = {key: pool.submit(build, *job) for key, job in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


def measure_ceilings(copy_elems=1 << 30, matmul_n=8192):
    """(copy bytes/s read+written of an XLA elementwise op on 4 GiB, bf16 matmul FLOP/s at 8192^3)."""
    x = jnp.ones((copy_elems,), jnp.float32)
    copy = jax.jit(lambda x: x + 1)
    jax.block_until_ready(copy(x))
    t0 = time.perf_counter()
    for _ in range(10):
        y = copy(x)
    jax.block_until_ready(y)
    copy_bps = 10 * 2 * x.nbytes / (time.perf_counter() - t0)
    del x, y
    a = jax.random.normal(jax.random.key(0), (matmul_n, matmul_n), jnp.bfloat16)
    mm = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.bfloat16))
    jax.block_until_ready(mm(a))
    t0 = time.perf_counter()
    for _ in range(20):
        z = mm(a)
    jax.block_until_ready(z)
    return copy_bps, 20 * 2 * matmul_n**3 / (time.perf_counter() - t0)


def record_header(commit, **fields):
    """A result JSON's header: device, date, commit, the exact command, then fields."""
    return dict(
        device=jax.devices()[0].device_kind,
        date=datetime.datetime.now(datetime.UTC).isoformat(),
        commit=commit,
        command=" ".join(["PYTHONPATH=. python3", *sys.argv]),
        **fields,
    )


def new_record(commit, **fields):
    """A benchmark JSON's header (`record_header`) with the copy and matmul ceilings measured now; returns
    (record, (copy bytes/s, matmul FLOP/s))."""
    ceilings = measure_ceilings()
    record = record_header(commit, copy_tb_per_s=ceilings[0] / 1e12, matmul_tflops=ceilings[1] / 1e12, **fields)
    return record, ceilings


def num_sets_for(C, S, T, H):
    set_bytes = 2 * (C * S * (R + P) + C * T * H * (R + P) + C * T * (R + P))
    return int(min(16, max(2, math.ceil(2 * L2_BYTES / set_bytes))))


def roofline(C, S, T, H, visibility, ceilings):
    cache_bytes = C * S * (R + P) * 2
    visible_keys = C * T * H * S + H * int(np.asarray(visibility).sum())
    flops = 2 * visible_keys * (R + P + R)
    floor = max(cache_bytes / HBM_BYTES_PER_S, flops / MMA_FLOPS_PER_S)
    measured_floor = max(cache_bytes / ceilings[0], flops / ceilings[1])
    return cache_bytes, flops, floor, measured_floor


def plan_summary(plan, C):
    """{groups: G, groups_per_seq: [...]} of a split plan, for the JSON rows."""
    return dict(groups=len(plan), groups_per_seq=[len(groups) for groups in sequence_groups(plan, C)])


def relative_error(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def gpu_checks():
    """bf16 kernel vs float32 reference on the GPU, both prefix kernels: ragged prefixes, random trees,
    row counts that are no multiple of 64 (72, 8), tails of 1, 5 and 9 rows (the Mosaic kernel reads the first two
    unpadded), the largest tree (129 tail rows, no prefix in one sequence)."""
    rows = []
    for C, S, T, H, prefix in [
        (3, 3008, 33, 64, [3008, 0, 1234]),
        (4, 1000, 1, 64, [1000, 1, 127, 0]),
        (2, 776, 9, 8, [5, 776]),
        (2, 1024, 1, 8, [1024, 3]),
        (2, 1000, 129, 8, [0, 999]),
        (2, 1024, 5, 64, [1024, 0]),
    ]:
        args = make_input_sets(C, S, T, H, 1, seed=7, prefix_len=prefix)[0]
        reference = reference_output(args)
        for prefix_kernel in ("triton", "mosaic"):
            try:
                out = jax.jit(functools.partial(tree_mla_attention, scale=SCALE, prefix_kernel=prefix_kernel))(*args)
                rows.append(
                    dict(
                        C=C,
                        S=S,
                        T=T,
                        H=H,
                        prefix_kernel=prefix_kernel,
                        rel_err=relative_error(out, reference),
                        finite=bool(jnp.isfinite(out.astype(jnp.float32)).all()),
                    )
                )
            except Exception as e:
                rows.append(
                    dict(C=C, S=S, T=T, H=H, prefix_kernel=prefix_kernel, error=f"{type(e).__name__}: {str(e)[:300]}")
                )
            print("check", rows[-1], flush=True)
    return rows


def reference_output(args):
    f32_args = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    return jax.jit(functools.partial(tree_mla_attention_reference, scale=SCALE))(*f32_args)


# Candidates: the Mosaic prefix kernel (tiles fixed) and Triton tiles, checked offline for shared memory
# (Triton 3.9 for sm_90a) before they were first raced.
MOSAIC = {"mosaic": dict(prefix_kernel="mosaic")}
WIDE = {  # Triton, block_m = 64 (H = 64, or H = 8 with T >= 8), 8 warps
    "k64_r256": dict(prefix_kernel="triton", block_m=64, block_k=64, block_r=256, num_stages=2),
    "k32_r512_s3": dict(prefix_kernel="triton", block_m=64, block_k=32, block_r=512, num_stages=3),
}
NARROW = {  # Triton, H = 8, T = 1: block_m = 16, 4 warps
    "k64_r512": dict(prefix_kernel="triton", block_m=16, block_k=64, block_r=512, num_stages=2, num_warps=4),
    "k32_r512_s4": dict(prefix_kernel="triton", block_m=16, block_k=32, block_r=512, num_stages=4, num_warps=4),
}
TUNE = {
    "verify": ((8, 32768, 65, 64), {**MOSAIC, **WIDE}),
    "decode": ((8, 32768, 1, 64), {**MOSAIC, "mosaic_sp32": dict(prefix_kernel="mosaic", num_splits=32), **WIDE}),
    "decode_tp8": ((8, 32768, 1, 8), {**MOSAIC, **NARROW}),
}


def regime(T, H):
    if H * T <= 16:
        return "decode_tp8"
    return "decode" if T == 1 else "verify"


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


def time_row(point, arg_sets, ceilings, kernel, knobs, naive=None, reference=None):
    C, S, T, H = point
    cache_bytes, flops, floor, measured_floor = roofline(C, S, T, H, arg_sets[0][5], ceilings)
    row = dict(
        C=C,
        prefix=S,
        T=T,
        H=H,
        knobs=knobs,
        cache_bytes=cache_bytes,
        flops=flops,
        floor_s=floor,
        measured_floor_s=measured_floor,
    )
    if isinstance(kernel, Exception):
        row["error"] = f"{type(kernel).__name__}: {str(kernel)[:300]}"
    else:
        if reference is not None:
            row["rel_err"] = relative_error(kernel(*arg_sets[0]), reference)
        sec = seconds_per_call(kernel, arg_sets)
        row.update(
            time_s=sec,
            pct_of_floor=100 * floor / sec,
            pct_of_measured_floor=100 * measured_floor / sec,
            tflops=flops / sec / 1e12,
            cache_tb_per_s=cache_bytes / sec / 1e12,
        )
    if naive is not None and not isinstance(naive, Exception):
        row.update(naive_xla_s=seconds_per_call(naive, arg_sets[:2], target_s=0.03, repeats=3))
        row["naive_pct_of_floor"] = 100 * floor / row["naive_xla_s"]
        if "time_s" in row:
            row["speedup_vs_naive"] = row["naive_xla_s"] / row["time_s"]
    return row


def fmt(row):
    head = f"{row['C']:>3} {row['prefix']:>6} {row['T']:>4} {row['H']:>3}"
    if "error" in row:
        return f"{head}  ERROR {row['error'][:100]}  {row['knobs']}"
    naive = f"{row['naive_xla_s'] * 1e3:9.3f} {row['speedup_vs_naive']:6.2f}x" if "naive_xla_s" in row else " " * 17
    return (
        f"{head} {row['time_s'] * 1e3:9.3f} {row['floor_s'] * 1e3:9.3f} {row['pct_of_floor']:6.1f}% "
        f"{row['tflops']:7.1f} {row['cache_tb_per_s']:6.2f} {naive}  {row['knobs']}"
    )


HEADER = "  C prefix    T   H   time_ms  floor_ms  %floor  TFLOP/s  TB/s  naive_ms speedup  knobs"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget_s", type=float, default=170.0, help="stop starting new points after this")
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    start = time.perf_counter()
    record, ceilings = new_record(
        args.commit,
        jax=jax.__version__,
        tune=[],
        rows=[],
        skipped=[],
        floor_model=dict(hbm_tb_per_s=HBM_BYTES_PER_S / 1e12, mma_tflops=MMA_FLOPS_PER_S / 1e12),
    )
    save = lambda: json.dump(record, open(args.out, "w"), indent=1)
    print(f"ceilings: copy {ceilings[0] / 1e12:.2f} TB/s, bf16 matmul {ceilings[1] / 1e12:.0f} TFLOP/s", flush=True)

    # 1. Tune: every candidate tile on one shape per regime, checked against the float32 reference.
    jobs = {
        (name, cand): (functools.partial(tree_mla_attention, scale=SCALE, **knobs), point)
        for name, (point, cands) in TUNE.items()
        for cand, knobs in cands.items()
    }
    sweep_naive = {
        point[:4]: (functools.partial(naive_xla, scale=SCALE), point[:4])
        for point in SWEEP
        if point[4] and point[0] * point[2] * point[3] * (point[1] + point[2]) * 6 <= NAIVE_MAX_SCORE_BYTES
    }
    compiled = compile_all({**jobs, **{("naive", p): job for p, job in sweep_naive.items()}})
    print(f"compiled tune candidates + naive baselines [{time.perf_counter() - start:.0f}s]", flush=True)
    record["checks"] = gpu_checks()
    best = {}
    for name, (point, cands) in TUNE.items():
        arg_sets = make_input_sets(*point, num_sets_for(*point))
        reference = reference_output(arg_sets[0])
        for cand, knobs in cands.items():
            row = time_row(point, arg_sets, ceilings, compiled[(name, cand)], knobs, reference=reference)
            row.update(regime=name, candidate=cand)
            record["tune"].append(row)
            print("tune", name, fmt(row), f"rel_err={row.get('rel_err', float('nan')):.1e}", flush=True)
            fixed_splits = "num_splits" in knobs  # shown for comparison; the sweep keeps the wrapper's split rule
            if (
                "time_s" in row
                and row["rel_err"] < 1e-2
                and not fixed_splits
                and row["time_s"] < best.get(name, (None, math.inf))[1]
            ):
                best[name] = (knobs, row["time_s"])
        del arg_sets, reference
        save()
    record["chosen_knobs"] = {name: knobs for name, (knobs, _) in best.items()}
    print("chosen", record["chosen_knobs"], f"[{time.perf_counter() - start:.0f}s]", flush=True)

    # 2. Sweep with the chosen tile per regime.
    knobs_for = lambda point: record["chosen_knobs"].get(regime(point[2], point[3]), {})
    kernels = compile_all(
        {p[:4]: (functools.partial(tree_mla_attention, scale=SCALE, **knobs_for(p)), p[:4]) for p in SWEEP}
    )
    print(f"compiled sweep [{time.perf_counter() - start:.0f}s]", flush=True)
    for *point, _ in SWEEP:
        point = tuple(point)
        if time.perf_counter() - start > args.budget_s:
            record["skipped"].append(point)
            continue
        arg_sets = make_input_sets(*point, num_sets_for(*point))
        row = time_row(point, arg_sets, ceilings, kernels[point], knobs_for(point), compiled.get(("naive", point)))
        row["regime"] = regime(point[2], point[3])
        if row["regime"] != "decode_tp8":  # the Mosaic kernel's split plan: groups of each sequence
            row.update(plan_summary(mosaic_plan(point[0], point[2] * point[3], point[1], point[2]), point[0]))
        record["rows"].append(row)
        print(fmt(row), flush=True)
        del arg_sets
        save()
    save()
    print("\n" + HEADER)
    for row in record["rows"]:
        print(fmt(row))
    print("skipped:", record["skipped"])


if __name__ == "__main__":
    main()
