"""Benchmark tree_mla_attention (Pallas-Triton) against its roofline floor and a naive XLA version.

  PYTHONPATH=. python3 scripts/bench_verify_attn.py --mode sweep --out bench/results/verify_attn_h200.json
  --mode spike: GPU correctness check plus a tile-configuration comparison on three key shapes.

Floor = max(latent-cache bytes / 4.0 TB/s, FLOPs / 620 TFLOP/s), FLOPs = 2*C*T*H*(S + visible tail)*(R+P+R).
The same run measures the copy and bf16 matmul ceilings (pct_of_measured_floor uses those). Timing: one
jit runs the op on several independent input sets (more than 2x L2 in total), median of repeats.
"""
import argparse
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

from pallas_kernels.tree_mla_attention import tree_mla_attention, tree_mla_attention_reference

R, P = 512, 64
HBM_BYTES_PER_S, MMA_FLOPS_PER_S = 4.0e12, 620e12
L2_BYTES = 60 << 20
SCALE = 0.1
NAIVE_MAX_SCORE_BYTES = 24 << 30


def random_tree_visibility(rng, C, T):
  """[C, T, T] ancestor-or-self relation of random trees with parents[i] < i (node 0 is the root)."""
  vis = np.zeros((C, T, T), bool)
  for c in range(C):
    for i in range(T):
      vis[c, i, i] = True
      if i:
        vis[c, i] |= vis[c, rng.integers(0, i)]
  return vis


def make_input_sets(C, S, T, H, num_sets, seed=0, prefix_len=None):
  """num_sets independent bf16 argument tuples (q_lat, q_rope, cache, prefix_len, tail, visibility)."""
  rng = np.random.default_rng(seed)
  visibility = jnp.asarray(random_tree_visibility(rng, C, T))
  prefix_len = jnp.full((C,), S, jnp.int32) if prefix_len is None else jnp.asarray(prefix_len, jnp.int32)
  sets = []
  for i in range(num_sets):
    k = jax.random.split(jax.random.key(seed * 1000 + i), 4)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16)
    sets.append((normal(k[0], (C, T, H, R)), normal(k[1], (C, T, H, P)), normal(k[2], (C, S, R + P)),
                 prefix_len, normal(k[3], (C, T, R + P)), visibility))
  return sets


def naive_xla(q_lat, q_rope, cache, prefix_len, tail, visibility, *, scale):
  """Baseline: bf16 einsums over the whole cache and the tail, masked float32 softmax."""
  f32 = jnp.float32
  def scores(keys):
    s = jnp.einsum("cthr,csr->cths", q_lat, keys[..., :R], preferred_element_type=f32)
    return (s + jnp.einsum("cthp,csp->cths", q_rope, keys[..., R:], preferred_element_type=f32)) * scale
  S = cache.shape[1]
  visible = jnp.concatenate([jnp.broadcast_to((jnp.arange(S) < prefix_len[:, None])[:, None], (*visibility.shape[:2], S)),
                             visibility], axis=-1)[:, :, None, :]
  p = jax.nn.softmax(jnp.where(visible, jnp.concatenate([scores(cache), scores(tail)], -1), -jnp.inf), axis=-1)
  p = p.astype(q_lat.dtype)
  o = jnp.einsum("cths,csr->cthr", p[..., :S], cache[..., :R], preferred_element_type=f32)
  return (o + jnp.einsum("cths,csr->cthr", p[..., S:], tail[..., :R], preferred_element_type=f32)).astype(q_lat.dtype)


def seconds_per_call(fn, arg_sets, repeats=5):
  """Median over repeats of one jitted launch that applies fn to every argument set, per call."""
  run_all = jax.jit(lambda sets: [fn(*args) for args in sets])
  jax.block_until_ready(run_all(arg_sets))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(run_all(arg_sets))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) / len(arg_sets)


def measure_ceilings():
  x = jnp.ones((1 << 30,), jnp.float32)  # 4 GiB
  copy = jax.jit(lambda x: x + 1)
  jax.block_until_ready(copy(x))
  t0 = time.perf_counter()
  for _ in range(10):
    y = copy(x)
  jax.block_until_ready(y)
  copy_bps = 10 * 2 * x.nbytes / (time.perf_counter() - t0)
  del x, y
  a = jnp.ones((8192, 8192), jnp.bfloat16)
  mm = jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.bfloat16))
  jax.block_until_ready(mm(a))
  t0 = time.perf_counter()
  for _ in range(20):
    z = mm(a)
  jax.block_until_ready(z)
  mm_flops = 20 * 2 * 8192 ** 3 / (time.perf_counter() - t0)
  return copy_bps, mm_flops


def num_sets_for(C, S, T, H):
  set_bytes = 2 * (C * S * (R + P) + C * T * H * (R + P) + C * T * (R + P))
  return int(min(32, max(2, math.ceil(2 * L2_BYTES / set_bytes))))


def roofline(C, S, T, H, visibility, ceilings):
  cache_bytes = C * S * (R + P) * 2
  visible_keys = C * T * H * S + H * int(np.asarray(visibility).sum())
  flops = 2 * visible_keys * (R + P + R)
  floor = max(cache_bytes / HBM_BYTES_PER_S, flops / MMA_FLOPS_PER_S)
  measured_floor = max(cache_bytes / ceilings[0], flops / ceilings[1])
  return cache_bytes, flops, floor, measured_floor


def relative_error(out, ref):
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def gpu_checks():
  """bf16 kernel vs float32 reference on the GPU, ragged prefixes and random trees."""
  rows = []
  for C, S, T, H, prefix in [(3, 3001, 33, 64, [3001, 0, 1234]), (4, 1000, 1, 64, [1000, 1, 127, 0]),
                             (2, 777, 9, 8, [5, 777])]:
    args = make_input_sets(C, S, T, H, 1, seed=7, prefix_len=prefix)[0]
    out = tree_mla_attention(*args, scale=SCALE)
    ref = tree_mla_attention_reference(*(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args),
                                       scale=SCALE)
    rows.append(dict(C=C, S=S, T=T, H=H, rel_err=relative_error(out, ref),
                     finite=bool(jnp.isfinite(out.astype(jnp.float32)).all())))
    print("check", rows[-1], flush=True)
  return rows


SPIKE_CONFIGS = [
    dict(block_m=64, block_k=32, num_warps=8, num_stages=2),
    dict(block_m=64, block_k=64, num_warps=8, num_stages=2),
    dict(block_m=64, block_k=32, num_warps=8, num_stages=3),
    dict(block_m=64, block_k=16, num_warps=8, num_stages=4),
    dict(block_m=128, block_k=32, block_r=256, num_warps=8, num_stages=2),
    dict(block_m=64, block_k=32, block_r=256, num_warps=4, num_stages=2),
    dict(block_m=32, block_k=64, num_warps=4, num_stages=2),
    dict(block_m=64, block_k=32, num_warps=4, num_stages=2),
]
SPIKE_SHAPES = [  # (C, S, T, H, extra configs)
    (8, 32768, 65, 64, []),
    (8, 32768, 1, 64, [dict(block_m=64, block_k=64, num_warps=8, num_stages=2, num_splits=33),
                       dict(block_m=64, block_k=64, num_warps=8, num_stages=2, num_splits=8)]),
    (8, 32768, 1, 8, [dict(block_m=16, block_k=64, num_warps=4, num_stages=3),
                      dict(block_m=16, block_k=128, num_warps=4, num_stages=3),
                      dict(block_m=16, block_k=64, num_warps=4, num_stages=2, num_splits=33)]),
]

SWEEP = [  # (C, S, T, H), most important first
    (8, 32768, 65, 64), (8, 32768, 1, 64), (1, 8192, 65, 64), (8, 8192, 65, 64), (8, 32768, 33, 64),
    (8, 32768, 65, 8), (8, 32768, 1, 8), (8, 8192, 1, 64), (1, 32768, 1, 64), (1, 32768, 65, 64),
    (1, 65536, 33, 64), (16, 4096, 33, 64), (8, 65536, 1, 64), (8, 8192, 129, 64), (16, 32768, 1, 64),
    (1, 8192, 1, 64), (1, 8192, 33, 64), (8, 8192, 33, 64), (8, 1024, 65, 64), (8, 1024, 1, 64),
    (1, 1024, 1, 64), (1, 1024, 33, 64), (1, 1024, 65, 64), (8, 1024, 33, 64),
    (1, 32768, 33, 64), (8, 32768, 33, 8), (8, 8192, 65, 8), (8, 8192, 33, 8), (8, 8192, 1, 8),
    (1, 32768, 65, 8), (1, 32768, 1, 8), (1, 8192, 65, 8), (1, 8192, 1, 8), (1, 1024, 65, 8),
    (8, 1024, 65, 8), (8, 1024, 1, 8), (1, 1024, 1, 8), (16, 8192, 129, 8),
]


def bench_point(C, S, T, H, arg_sets, ceilings, knobs, with_naive, reference=None):
  """Times the kernel with `knobs` (and the naive XLA version) on arg_sets; checks it against `reference`
  (the float32 reference output on arg_sets[0]) when given."""
  cache_bytes, flops, floor, measured_floor = roofline(C, S, T, H, arg_sets[0][5], ceilings)
  row = dict(C=C, prefix=S, T=T, H=H, knobs=knobs, cache_bytes=cache_bytes, flops=flops, floor_s=floor)
  t0 = time.perf_counter()
  attention = functools.partial(tree_mla_attention, scale=SCALE, **knobs)
  try:
    if reference is not None:
      row["rel_err"] = relative_error(jax.jit(attention)(*arg_sets[0]), reference)
    sec = seconds_per_call(attention, arg_sets)
    row.update(time_s=sec, pct_of_floor=100 * floor / sec, pct_of_measured_floor=100 * measured_floor / sec,
               tflops=flops / sec / 1e12, cache_tb_per_s=cache_bytes / sec / 1e12)
  except Exception as e:  # a tile that does not compile (shared memory, registers) is a result
    row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
  if with_naive and C * T * H * (S + T) * 6 <= NAIVE_MAX_SCORE_BYTES:
    naive = seconds_per_call(functools.partial(naive_xla, scale=SCALE), arg_sets[:2], repeats=3)
    row.update(naive_xla_s=naive, naive_pct_of_floor=100 * floor / naive)
    if "time_s" in row:
      row["speedup_vs_naive"] = naive / row["time_s"]
  row["wall_s"] = time.perf_counter() - t0
  return row


def reference_output(args):
  f32_args = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
  return jax.jit(functools.partial(tree_mla_attention_reference, scale=SCALE))(*f32_args)


def fmt(row):
  if "error" in row:
    return f"{row['C']:>3} {row['prefix']:>6} {row['T']:>4} {row['H']:>3}  ERROR {row['error'][:90]}  {row['knobs']}"
  naive = f"{row['naive_xla_s'] * 1e3:9.3f} {row['speedup_vs_naive']:6.2f}x" if "naive_xla_s" in row else " " * 17
  return (f"{row['C']:>3} {row['prefix']:>6} {row['T']:>4} {row['H']:>3} {row['time_s'] * 1e3:9.3f} "
          f"{row['floor_s'] * 1e3:9.3f} {row['pct_of_floor']:6.1f}% {row['tflops']:7.1f} {row['cache_tb_per_s']:6.2f} "
          f"{naive}  {row['knobs']}")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--mode", choices=["spike", "sweep"], default="sweep")
  parser.add_argument("--out", required=True)
  parser.add_argument("--budget_s", type=float, default=170.0, help="stop starting new points after this")
  parser.add_argument("--commit", default="unknown")
  parser.add_argument("--knobs", default="{}", help="JSON dict of tree_mla_attention block knobs for --mode sweep")
  parser.add_argument("--knobs_h8", default=None, help="JSON knobs for H=8 points (default: --knobs)")
  args = parser.parse_args()
  start = time.perf_counter()
  ceilings = measure_ceilings()
  print(f"ceilings: copy {ceilings[0] / 1e12:.2f} TB/s, bf16 matmul {ceilings[1] / 1e12:.0f} TFLOP/s", flush=True)
  record = dict(device=jax.devices()[0].device_kind, date=datetime.datetime.now(datetime.UTC).isoformat(),
                commit=args.commit, command=" ".join(["PYTHONPATH=. python3", *sys.argv]),
                jax=jax.__version__, copy_tb_per_s=ceilings[0] / 1e12, matmul_tflops=ceilings[1] / 1e12,
                floor_model=dict(hbm_tb_per_s=4.0, mma_tflops=620), rows=[], skipped=[])
  record["checks"] = gpu_checks()
  if args.mode == "spike":
    work = [((C, S, T, H), (SPIKE_CONFIGS if H == 64 else SPIKE_CONFIGS[:1]) + extra, False)
            for C, S, T, H, extra in SPIKE_SHAPES]
  else:
    knobs = json.loads(args.knobs)
    knobs_h8 = json.loads(args.knobs_h8) if args.knobs_h8 else knobs
    work = [(point, [knobs if point[3] == 64 else knobs_h8], True) for point in SWEEP]
  for point, configs, with_naive in work:
    if time.perf_counter() - start > args.budget_s:
      record["skipped"].extend(dict(point=point, knobs=knobs) for knobs in configs)
      continue
    arg_sets = make_input_sets(*point, num_sets_for(*point))
    reference = reference_output(arg_sets[0]) if args.mode == "spike" else None
    for knobs in configs:
      if time.perf_counter() - start > args.budget_s:
        record["skipped"].append(dict(point=point, knobs=knobs))
        continue
      row = bench_point(*point, arg_sets, ceilings, knobs, with_naive, reference)
      record["rows"].append(row)
      print(fmt(row), f"rel_err={row.get('rel_err', float('nan')):.2e} [{row['wall_s']:.1f}s]", flush=True)
      with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    del arg_sets, reference
  with open(args.out, "w") as f:
    json.dump(record, f, indent=1)
  print("\n  C prefix    T   H   time_ms  floor_ms  %floor  TFLOP/s  TB/s  naive_ms speedup  knobs")
  for row in record["rows"]:
    print(fmt(row))
  print("skipped:", [s["point"] for s in record["skipped"]])


if __name__ == "__main__":
  main()
