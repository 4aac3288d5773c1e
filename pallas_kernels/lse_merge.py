"""Exact log-sum-exp merge of split-K attention partials as one Pallas (Triton) kernel, its jnp reference and
wrapper.

Sequence c's output row is sum_n w_n o[g_n] / sum_n w_n with w_n = 2^(lse[g_n] - max_n lse[g_n]), over the
partials g_n = groups[c, n] (base-2 log-sum-exp; -1 pads a sequence with fewer partials). Each program takes a
block_m x block_r tile of one sequence's output and loads that tile of all its partials at once, where they lie
(no gather is materialised, padding rows of the partials are never read); the result is written in the output
dtype. XLA made three
kernels of the same merge (weights, a select, the weighted sum, 13 us for decode at C=8/32K/64 heads under ncu,
bench/verify_attn.md run 28).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def group_index(sequence_groups):
  """int32 [C, N]: each sequence's partial indices (lists), padded with -1 to the longest."""
  N = max(len(groups) for groups in sequence_groups)
  return np.asarray([list(groups) + [-1] * (N - len(groups)) for groups in sequence_groups], np.int32)


def merge_reference(o_GMR, lse_GM, groups_CN, out_dtype=jnp.float32):
  """float32 merge: o [G, M, R] normalised partials, lse [G, M] (base 2, -inf where a partial saw nothing),
  groups [C, N] int32 partial indices (-1: none) -> [C, M, R] in out_dtype (0 where nothing was seen)."""
  valid_CN1 = (np.asarray(groups_CN) >= 0)[..., None]
  index = np.maximum(groups_CN, 0)
  lse_CNM = jnp.where(valid_CN1, lse_GM[index], -jnp.inf)
  m_CM = jnp.max(lse_CNM, axis=1)
  m_CM = jnp.where(jnp.isfinite(m_CM), m_CM, 0.0)
  w_CNM = jnp.exp2(lse_CNM - m_CM[:, None])
  w_sum_CM = jnp.sum(w_CNM, axis=1)
  o_CMR = jnp.einsum("cnm,cnmr->cmr", w_CNM, o_GMR[index], precision=lax.Precision.HIGHEST)
  return (o_CMR / jnp.where(w_sum_CM > 0, w_sum_CM, 1.0)[..., None]).astype(out_dtype)


def _merge_kernel(groups_ref, lse_ref, o_ref, out_ref, *, num_rows, rows_in, block_m, block_r):
  """Grid (c, m block, r block). groups [C, block_n]; lse [G * rows_in] and o [G * rows_in * R] (flat views) ->
  out [C, num_rows, R]. Loads every partial's [block_m, block_r] tile at once ([block_n, block_m, block_r],
  block_n >= N, the rest masked): no loop, so the loads are all in flight together."""
  R = out_ref.shape[2]
  c, m_blk, r_blk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  g = groups_ref[c, :]  # [block_n], padded with -1
  rows = m_blk * block_m + jnp.arange(block_m)
  cols = r_blk * block_r + jnp.arange(block_r)
  seen = (g >= 0)[:, None] & (rows < num_rows)[None, :]  # [block_n, block_m]
  flat_rows = jnp.maximum(g, 0)[:, None] * rows_in + rows[None, :]
  lse = plgpu.load(lse_ref.at[flat_rows], mask=seen, other=-jnp.inf)
  m = jnp.max(lse, axis=0)
  w = jnp.exp2(lse - jnp.where(m == -jnp.inf, 0.0, m)[None, :])  # 0 where unseen
  o = plgpu.load(o_ref.at[flat_rows[:, :, None] * R + cols[None, None, :]], mask=seen[:, :, None], other=0.0)
  w_sum = jnp.sum(w, axis=0)
  out = jnp.sum(w[:, :, None] * o, axis=0) / jnp.where(w_sum > 0, w_sum, 1.0)[:, None]
  plgpu.store(out_ref.at[c, pl.ds(m_blk * block_m, block_m), pl.ds(r_blk * block_r, block_r)],
              out.astype(out_ref.dtype), mask=(rows < num_rows)[:, None])


_TILE_ELEMS = 8192  # partial values a program loads (32 KB: 64 registers a thread at 4 warps)


def _tiles(N, M, R):
  """(block_n, block_m, block_r), powers of two: block_n >= N, then columns (16 to 128), then rows, so that
  block_n * block_m * block_r stays near _TILE_ELEMS."""
  block_n = pl.next_power_of_2(N)
  block_r = min(R, 128, max(16, _TILE_ELEMS // block_n))
  block_m = min(pl.next_power_of_2(M), max(1, _TILE_ELEMS // (block_n * block_r)))
  return block_n, block_m, block_r


@functools.partial(jax.jit, static_argnames=["num_rows", "out_dtype", "interpret"])
def merge_partials(o_GMR, lse_GM, groups_CN, *, num_rows=None, out_dtype=jnp.float32, interpret: bool = False):
  """The merge of `merge_reference` on the GPU (Pallas-Triton; `interpret` runs it on the CPU) of the first
  num_rows (default M) rows of each partial; the rest (padding) is never read. groups_CN: int32 [C, N]
  (`group_index`); R a power of two."""
  G, M, R = o_GMR.shape
  C, N = groups_CN.shape
  num_rows = M if num_rows is None else num_rows
  if lse_GM.shape != (G, M) or o_GMR.dtype != jnp.float32 or lse_GM.dtype != jnp.float32:
    raise ValueError(f"o must be float32 [G, M, R] and lse float32 [G, M] = [{G}, {M}], "
                     f"got {o_GMR.dtype}{o_GMR.shape} and {lse_GM.dtype}{lse_GM.shape}")
  if R < 16 or R & (R - 1) or N < 1 or not 0 < num_rows <= M:
    raise ValueError(f"R ({R}) must be a power of two >= 16, groups [C, N] have N >= 1 (got {groups_CN.shape}) "
                     f"and num_rows ({num_rows}) be in [1, M = {M}]")
  block_n, block_m, block_r = _tiles(N, num_rows, R)
  groups = jnp.pad(groups_CN.astype(jnp.int32), [(0, 0), (0, block_n - N)], constant_values=-1)
  return pl.pallas_call(
      functools.partial(_merge_kernel, num_rows=num_rows, rows_in=M, block_m=block_m, block_r=block_r),
      grid=(C, pl.cdiv(num_rows, block_m), R // block_r),
      out_shape=jax.ShapeDtypeStruct((C, num_rows, R), out_dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4), interpret=interpret, name="lse_merge",
  )(groups, lse_GM.reshape(-1), o_GMR.reshape(-1))
