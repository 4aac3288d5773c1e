"""Benchmark pallas_kernels.int4_moe_gemm.fused_moe at K2.6 shapes against its memory/compute floor.

Rows: Triton tilings (int4_moe_gemm) and the Mosaic GPU kernels (int4_moe_mosaic, "mosaic_m<block_m>"); "*" marks
the wrapper's default (tiling=None), which is the Mosaic kernels for bf16 at every M.

K2.6 MoE layer: 384 experts, top-8, D=7168, I=2048, uniform random routing. For each M it reports the time,
touched-expert bytes (packed + scales), FLOPs, floor = max(bytes / copy ceiling, FLOPs / matmul ceiling) with
both ceilings measured in the same run, % of floor and us/token; plus tile variants and three XLA baselines
(unpack-from-int32 + einsum, jnp.int4 + einsum, bf16 ragged_dot). Every Pallas output is checked against
fused_moe_reference first. Timing: a jitted fori_loop of back-to-back calls (each call's output is the next
call's input, routings rotate), median of repeats; the touched weights of one call exceed L2.

GPU:  PYTHONPATH=. python3 scripts/bench_moe_gemm.py --race mosaic --out bench/results/moe_gemm_h200.json
CPU:  PYTHONPATH=. .venv/bin/python scripts/bench_moe_gemm.py --quick   (tiny shapes, interpret mode)
"""

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import int4_moe_gemm as moe
from pallas_kernels import int4_moe_mosaic

warnings.filterwarnings("ignore", category=DeprecationWarning, message="The Pallas Triton backend is deprecated")

K26 = dict(num_experts=384, top_k=8, d=7168, i=2048)
QUICK = dict(num_experts=16, top_k=4, d=256, i=256)
SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
T = moe.Tiling
TILINGS = {  # named candidates; all use the PTX bf16x2 dequant; "_nf" = N tiles fastest in launch order
    "pair_n64": T(per_pair=True, block_n_gate_up=64, block_n_down=128, dequant="asm"),
    "pair_n64_kw16": T(
        per_pair=True, block_n_gate_up=64, block_n_down=128, block_kw_gate_up=16, block_kw_down=16, dequant="asm"
    ),
    "pair_n64_kw16_s4": T(
        per_pair=True,
        block_n_gate_up=64,
        block_n_down=128,
        block_kw_gate_up=16,
        block_kw_down=16,
        num_stages=4,
        dequant="asm",
    ),
    "m16_n64": T(block_m=16, dequant="asm"),
    "m16_n64_nf": T(block_m=16, n_fastest=True, dequant="asm"),
    "m16_n64_kw16_nf": T(block_m=16, block_kw_gate_up=16, block_kw_down=16, n_fastest=True, dequant="asm"),
    "m16_n64_kw16_s4_nf": T(
        block_m=16, block_kw_gate_up=16, block_kw_down=16, num_stages=4, n_fastest=True, dequant="asm"
    ),
    "m16_n64_d64_nf": T(block_m=16, block_n_down=64, n_fastest=True, dequant="asm"),
    "m32_n64_nf": T(block_m=32, n_fastest=True, dequant="asm"),
    "m32_n64_d64_nf": T(block_m=32, block_n_down=64, n_fastest=True, dequant="asm"),
    "m32_n64_kw16_nf": T(block_m=32, block_kw_gate_up=16, block_kw_down=16, n_fastest=True, dequant="asm"),
    "m32_n64_kw16_s4_nf": T(
        block_m=32, block_kw_gate_up=16, block_kw_down=16, num_stages=4, n_fastest=True, dequant="asm"
    ),
    "m32_n128_w8_nf": T(block_m=32, block_n_gate_up=128, block_n_down=256, num_warps=8, n_fastest=True, dequant="asm"),
    # "_swap": weights as the MMA's register operand (out^T = w^T x^T), so Triton emits wgmma
    "m16_n64_swap_nf": T(block_m=16, n_fastest=True, swap_ab=True, dequant="asm"),
    "m16_n64_kw16_swap_nf": T(
        block_m=16, block_kw_gate_up=16, block_kw_down=16, n_fastest=True, swap_ab=True, dequant="asm"
    ),
    "m32_n64_swap_nf": T(block_m=32, n_fastest=True, swap_ab=True, dequant="asm"),
    "m32_n64_kw16_swap_nf": T(
        block_m=32, block_kw_gate_up=16, block_kw_down=16, n_fastest=True, swap_ab=True, dequant="asm"
    ),
    "m32_n64_kw16_s4_swap_nf": T(
        block_m=32, block_kw_gate_up=16, block_kw_down=16, num_stages=4, n_fastest=True, swap_ab=True, dequant="asm"
    ),
    "m64_n64_kw16_swap_nf": T(
        block_m=64, block_kw_gate_up=16, block_kw_down=16, n_fastest=True, swap_ab=True, dequant="asm"
    ),
    "m64_n128_kw16_w8_swap_nf": T(
        block_m=64,
        block_n_gate_up=128,
        block_n_down=256,
        block_kw_gate_up=16,
        block_kw_down=16,
        num_warps=8,
        n_fastest=True,
        swap_ab=True,
        dequant="asm",
    ),
}
SWAP_RACE = {  # run 8: swapped-operand (wgmma) candidates against the current defaults
    16: ("m16_n64_nf", "m16_n64_swap_nf", "m16_n64_kw16_swap_nf"),
    128: ("m16_n64_nf", "m16_n64_swap_nf", "m16_n64_kw16_swap_nf", "m32_n64_kw16_swap_nf"),
    256: ("m16_n64_nf", "m16_n64_swap_nf", "m16_n64_kw16_swap_nf", "m32_n64_kw16_swap_nf"),
    512: ("m16_n64_nf", "m16_n64_swap_nf", "m16_n64_kw16_swap_nf", "m32_n64_kw16_swap_nf", "m32_n64_swap_nf"),
    1024: ("m32_n64_nf", "m32_n64_swap_nf", "m32_n64_kw16_swap_nf", "m32_n64_kw16_s4_swap_nf", "m64_n64_kw16_swap_nf"),
    4096: ("m32_n128_w8_nf", "m64_n64_kw16_swap_nf", "m64_n128_kw16_w8_swap_nf"),
}
MOSAIC = {  # int4_moe_mosaic.fused_moe_mosaic's arguments; "_full": every block multiplies all block_m rows
    **{f"mosaic_m{block_m}": dict(block_m=block_m) for block_m in (16, 32, 64)},
    **{f"mosaic_m{block_m}_full": dict(block_m=block_m, width_step=block_m) for block_m in (16, 32, 64)},
    "mosaic_m64_s16": dict(block_m=64, width_step=16),
}
WIDTHS_RACE = {  # run 18: each block's valid rows rounded up to a wgmma width against all block_m rows; run 19: sizes
    8: ("mosaic_m16", "mosaic_m16_full"),
    64: ("mosaic_m16", "mosaic_m16_full"),
    128: ("mosaic_m16", "mosaic_m32"),
    256: ("mosaic_m16", "mosaic_m16_full", "mosaic_m32"),
    512: ("mosaic_m16", "mosaic_m16_full", "mosaic_m32"),
    1024: ("mosaic_m32", "mosaic_m32_full", "mosaic_m64", "mosaic_m64_s16"),
    2048: ("mosaic_m32", "mosaic_m32_full", "mosaic_m64", "mosaic_m64_s16"),
    4096: ("mosaic_m64", "mosaic_m64_full", "mosaic_m64_s16", "mosaic_m32"),
}
MOSAIC_RACE = {  # the Mosaic GPU kernels against the Triton defaults
    1: ("pair_n64", "mosaic_m16"),
    2: ("pair_n64", "mosaic_m16"),
    4: ("pair_n64", "mosaic_m16"),
    8: ("m16_n64_nf", "mosaic_m16"),
    16: ("m16_n64_nf", "mosaic_m16"),
    32: ("m16_n64_nf", "mosaic_m16"),
    64: ("m16_n64_nf", "mosaic_m16"),
    128: ("m16_n64_nf", "mosaic_m16"),
    256: ("m16_n64_nf", "mosaic_m16", "mosaic_m32"),
    512: ("m16_n64_nf", "mosaic_m16", "mosaic_m32"),
    1024: ("m32_n64_nf", "mosaic_m16", "mosaic_m32", "mosaic_m64"),
    4096: ("m64_n64_kw16_swap_nf", "mosaic_m32", "mosaic_m64"),
}
CANDIDATES = {  # raced per M (the wrapper's choose_tiling is set from these results)
    1: ("pair_n64", "pair_n64_kw16", "pair_n64_kw16_s4"),
    2: ("pair_n64", "pair_n64_kw16", "pair_n64_kw16_s4"),
    4: ("pair_n64", "pair_n64_kw16", "pair_n64_kw16_s4"),
    8: ("m16_n64", "m16_n64_nf", "m16_n64_kw16_nf", "m16_n64_kw16_s4_nf", "pair_n64_kw16_s4"),
    16: ("m16_n64_nf", "m16_n64_kw16_nf", "m16_n64_kw16_s4_nf", "m16_n64_d64_nf"),
    32: ("m16_n64_nf", "m16_n64_kw16_nf", "m16_n64_kw16_s4_nf"),
    64: ("m16_n64_nf", "m16_n64_kw16_nf", "m16_n64_kw16_s4_nf"),
    128: ("m16_n64_nf", "m16_n64_kw16_nf", "m16_n64_kw16_s4_nf", "m32_n64_kw16_s4_nf", "m16_n64_d64_nf"),
    256: ("m16_n64_nf", "m16_n64_kw16_nf", "m16_n64_kw16_s4_nf", "m32_n64_kw16_s4_nf", "m16_n64_d64_nf"),
    512: (
        "m16_n64_nf",
        "m16_n64_kw16_s4_nf",
        "m32_n64_kw16_nf",
        "m32_n64_kw16_s4_nf",
        "m16_n64_d64_nf",
        "m32_n64_d64_nf",
    ),
    1024: ("m32_n64_nf", "m32_n64_kw16_nf", "m32_n64_kw16_s4_nf", "m16_n64_kw16_s4_nf", "m32_n64_d64_nf"),
    4096: ("m64_n64_kw16_swap_nf", "m32_n128_w8_nf", "m32_n64_kw16_s4_nf"),
}
BASELINE_MS = (1, 16, 128, 1024)
RAGGED_MS = (1, 16, 128)  # XLA lowers ragged_dot densely here (all experts): larger M runs out of memory


def random_weights(key, num_experts, d, i):
    """Random packed INT4 experts in the kernel layout; scales keep |y| below |x| so chained calls stay finite."""
    k13, k2, ks13, ks2 = jax.random.split(key, 4)
    bits = lambda k, shape: jax.lax.bitcast_convert_type(jax.random.bits(k, shape, jnp.uint32), jnp.int32)
    w13_packed = bits(k13, (num_experts, d // 8, 2, i))
    w2_packed = bits(k2, (num_experts, i // 8, d))
    w13_scale = (jax.random.uniform(ks13, (num_experts, d // 32, 2, i), minval=0.5, maxval=1.5) / (4 * d**0.5)).astype(
        jnp.bfloat16
    )
    w2_scale = (jax.random.uniform(ks2, (num_experts, i // 32, d), minval=0.5, maxval=1.5) / (4 * i**0.5)).astype(
        jnp.bfloat16
    )
    return w13_packed, w13_scale, w2_packed, w2_scale


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
        gate_up = jnp.dot(x, w13, preferred_element_type=jnp.float32)
        gate, up = jnp.split(gate_up, 2, axis=1)
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


def median_seconds(compiled, args, num_iters, repeats):
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - start) / num_iters)
    return statistics.median(times)


def copy_ceiling(nbytes, repeats):
    """Bytes read + written per second of a large XLA elementwise pass."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, 10, lambda _, v: v + 1.0, x))
    return 2 * x.nbytes / median_seconds(loop.lower(x).compile(), (x,), 10, repeats)


def matmul_ceiling(n, repeats):
    """bf16 n^3 XLA matmul FLOP/s."""
    a = jnp.ones((n, n), jnp.bfloat16)
    b = jnp.full((n, n), 1.0 / n, jnp.bfloat16)
    loop = jax.jit(lambda a, b: jax.lax.fori_loop(0, 10, lambda _, v: v @ b, a))
    return 2 * n**3 / median_seconds(loop.lower(a, b).compile(), (a, b), 10, repeats)


def rel_err(y, y_ref):
    y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
    return float(np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode (CPU smoke run)")
    parser.add_argument("--out", default=None, help="JSON path (default: bench/results/moe_gemm_<device>.json)")
    parser.add_argument("--ms", default=None, help="comma-separated M sweep")
    parser.add_argument("--no-baselines", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=200.0, help="start no new case after this many s")
    parser.add_argument("--commit", default=None, help="commit id to record (default: git rev-parse)")
    parser.add_argument(
        "--race",
        choices=("default", "swap", "mosaic", "widths"),
        default="default",
        help="candidate set per M: CANDIDATES (default), SWAP_RACE, MOSAIC_RACE or WIDTHS_RACE",
    )
    parser.add_argument(
        "--base-module",
        default=None,
        help="a copy of int4_moe_mosaic.py from another revision: every Mosaic case also runs "
        "with it, as '<name>@base' (a same-run A/B)",
    )
    args = parser.parse_args()
    base = None
    if args.base_module:
        spec = importlib.util.spec_from_file_location("int4_moe_mosaic_base", args.base_module)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
    candidates = {"swap": SWAP_RACE, "mosaic": MOSAIC_RACE, "widths": WIDTHS_RACE}.get(args.race, CANDIDATES)
    t_start = time.perf_counter()
    shapes = QUICK if args.quick else K26
    interpret = args.quick
    num_experts, top_k, d, i = shapes["num_experts"], shapes["top_k"], shapes["d"], shapes["i"]
    sweep = tuple(int(m) for m in args.ms.split(",")) if args.ms else ((1, 4, 32) if args.quick else SWEEP)
    device = jax.devices()[0]
    out_path = args.out or f"bench/results/moe_gemm_{'cpu_quick' if args.quick else device.device_kind}.json"
    commit = (
        args.commit
        or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    record = {
        "device": device.device_kind,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit or "unknown",
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "shapes": shapes,
        "rows": [],
    }

    def save():
        os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(record, f, indent=1)

    copy_bw = copy_ceiling((1 << 24) if args.quick else (8 << 30), args.repeats)
    mm_rate = matmul_ceiling(512 if args.quick else 8192, args.repeats)
    record["copy_bytes_per_s"], record["matmul_flop_per_s"] = copy_bw, mm_rate
    print(f"ceilings: copy {copy_bw / 1e12:.3f} TB/s, bf16 matmul {mm_rate / 1e12:.1f} TFLOP/s", flush=True)
    save()

    key = jax.random.PRNGKey(0)
    experts = random_weights(key, num_experts, d, i)
    cases = []  # (name, kind, M, fn, operands, tiling)
    routings = {}
    for m in sweep:
        ids, weights = random_routings(jax.random.fold_in(key, m), 4, m, num_experts, top_k)
        x = jax.random.normal(jax.random.fold_in(key, 10_000 + m), (m, d), jnp.float32).astype(jnp.bfloat16)
        routings[m] = (x.astype(jnp.float32) if args.quick else x, ids, weights)
        default = moe.fit_tiling(moe.choose_tiling(m, top_k, routings[m][0].dtype, interpret), d, i)
        names = () if args.quick else candidates.get(m, ())
        named = {name: moe.fit_tiling(TILINGS[name], d, i) for name in names if name not in MOSAIC}
        if default not in named.values():
            named["default"] = default
        for name, tiling in named.items():
            fn = functools.partial(moe.fused_moe, tiling=tiling, interpret=interpret)
            cases.append((name, "pallas", m, fn, experts, tiling))
        mosaic_names = [n for n in names if n in MOSAIC]
        wrapper_block_m = moe.mosaic_block_m(m, routings[m][0].dtype, d, i, interpret)
        if wrapper_block_m and f"mosaic_m{wrapper_block_m}" not in mosaic_names:  # the wrapper's default
            mosaic_names.append(f"mosaic_m{wrapper_block_m}")
        for name in mosaic_names:
            for suffix, module in (("", int4_moe_mosaic), ("@base", base)):
                if module is not None:
                    fn = functools.partial(module.fused_moe_mosaic, **MOSAIC[name])
                    cases.append((name + suffix, "mosaic", m, fn, experts, None))
    if not args.no_baselines:
        k4a, k4b, kba, kbb = jax.random.split(jax.random.fold_in(key, 7), 4)
        int4 = (
            jax.random.randint(k4a, (num_experts, d, 2 * i), -8, 8, jnp.int8).astype(jnp.int4),
            experts[1],
            jax.random.randint(k4b, (num_experts, i, d), -8, 8, jnp.int8).astype(jnp.int4),
            experts[3],
        )
        for m in routings if args.quick else [m for m in BASELINE_MS if m in routings]:
            cases.append(("xla_unpack_int32_einsum", "baseline", m, moe.fused_moe_reference, experts, None))
            cases.append(("xla_jnp_int4_einsum", "baseline", m, xla_int4_moe, int4, None))

    def floor_of(m):
        ids = np.asarray(routings[m][1])
        touched = np.mean([len(np.unique(r)) for r in ids])
        nbytes = touched * expert_bytes(d, i)
        flops = 6.0 * m * top_k * d * i
        return nbytes, flops, max(nbytes / copy_bw, flops / mm_rate)

    def iters_for(kind, m):
        if args.quick or kind == "baseline":  # baselines scan all experts: milliseconds per call at any M
            return 2 if args.quick else 3
        return int(np.clip(np.ceil(0.03 / floor_of(m)[2]), 3, 200))

    def compile_case(case):
        name, kind, m, fn, operands, _ = case
        x, ids, weights = routings[m]
        try:
            loop = chained_loop(fn, iters_for(kind, m))
            single = jax.jit(fn).lower(x, ids[0], weights[0], *operands).compile() if kind != "baseline" else None
            return loop.lower(x, ids, weights, *operands).compile(), single, None
        except Exception as e:  # a variant that Triton cannot compile is reported, not fatal
            return None, None, f"{type(e).__name__}: {str(e)[:300]}"

    references = {}

    def measure(case, compiled):
        name, kind, m, fn, operands, tiling = case
        loop, single, error = compiled
        nbytes, flops, floor = floor_of(m)
        row = {"name": name, "kind": kind, "M": m, "touched_bytes": nbytes, "flops": flops, "floor_s": floor}
        wrapper_block_m = moe.mosaic_block_m(m, routings[m][0].dtype, d, i, interpret)
        if tiling is not None:
            row["tiling"] = dataclasses.asdict(tiling)
            row["default"] = not wrapper_block_m and tiling == moe.fit_tiling(
                moe.choose_tiling(m, top_k, routings[m][0].dtype, interpret), d, i
            )
        elif kind == "mosaic":
            row["default"] = MOSAIC.get(name) == dict(block_m=wrapper_block_m)
        if error:
            row["error"] = error
        else:
            x, ids, weights = routings[m]
            if single is not None:
                if m not in references:
                    references[m] = jax.jit(moe.fused_moe_reference)(x, ids[0], weights[0], *experts)
                y = single(x, ids[0], weights[0], *operands)
                row["rel_err_vs_reference"] = rel_err(y, references[m])
                row["finite"] = bool(np.isfinite(np.asarray(y, np.float32)).all())
            seconds = median_seconds(loop, (x, ids, weights, *operands), iters_for(kind, m), args.repeats)
            row.update(
                time_s=seconds,
                us_per_token=seconds / m * 1e6,
                pct_of_floor=100 * floor / seconds,
                effective_tb_per_s=nbytes / seconds / 1e12,
            )
        record["rows"].append(row)
        save()
        print(json.dumps(row), flush=True)

    # Compile everything in parallel first (XLA autotunes baseline dots on the GPU while compiling, which
    # would disturb timings), then time one case at a time; start no case once the budget is spent.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1 if args.quick else 12) as pool:
        compiled = list(pool.map(compile_case, cases))
    print(f"compiled {len(cases)} cases in {time.perf_counter() - t_start:.0f} s", flush=True)
    for case, result in zip(cases, compiled):
        if time.perf_counter() - t_start > args.budget_s:
            print(f"budget spent, skipping {case[0]} M={case[2]}", flush=True)
            continue
        measure(case, result)
    if not args.no_baselines:  # last and one at a time: XLA autotunes these dense dots on copies of the weights
        del int4
        bf16 = (
            jax.random.normal(kba, (num_experts, d, 2 * i), jnp.bfloat16) * 0.01,
            jax.random.normal(kbb, (num_experts, i, d), jnp.bfloat16) * 0.01,
        )
        for m in routings if args.quick else [m for m in RAGGED_MS if m in routings]:
            if time.perf_counter() - t_start > args.budget_s:
                break
            case = ("ragged_dot_bf16", "baseline", m, ragged_dot_moe, bf16, None)
            measure(case, compile_case(case))

    print(
        f"\n{'M':>5} {'case (* = default)':<24} {'time us':>9} {'floor us':>9} {'% floor':>8} {'us/tok':>8} "
        f"{'TB/s':>6} {'err':>8}"
    )
    for row in record["rows"]:
        if "error" in row:
            print(f"{row['M']:>5} {row['name']:<24} ERROR {row['error'][:90]}")
            continue
        err = row.get("rel_err_vs_reference")
        name = row["name"] + (" *" if row.get("default") else "")
        print(
            f"{row['M']:>5} {name:<24} {row['time_s'] * 1e6:>9.1f} {row['floor_s'] * 1e6:>9.1f} "
            f"{row['pct_of_floor']:>8.1f} {row['us_per_token']:>8.2f} {row['effective_tb_per_s']:>6.2f} "
            f"{'' if err is None else f'{err:.1e}':>8}"
        )


if __name__ == "__main__":
    main()
