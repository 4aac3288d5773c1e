"""Exact log-sum-exp merge of split-K attention partials as one Pallas (Triton) kernel, its jnp reference and
wrapper.

Sequence c's output row is sum_n w_n o[g_n] / sum_n w_n with w_n = 2^(lse[g_n] - max_n lse[g_n]), over the
partials g_n = groups[c, n] (base-2 log-sum-exp; -1 pads a sequence with fewer partials). Each program takes a
block_m x block_r tile of one sequence's output and walks its partials in place: no gather of them is
materialised, the weights are made on the fly and the result is written in the output dtype. XLA made three
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


def _merge_kernel(groups_ref, lse_ref, o_ref, out_ref, *, num_rows, num_partials, block_m, block_r):
  """Grid (c, m block, r block). groups [C, N]; lse [G, M]; o [G, M, R] -> out [C, M, R]."""
  c, m_blk, r_blk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows = pl.ds(m_blk * block_m, block_m)
  row_ok = m_blk * block_m + jnp.arange(block_m) < num_rows
  cols = pl.ds(r_blk * block_r, block_r)

  def partial_lse(n):  # -> (partial index, its lse rows; -inf for padding)
    g = groups_ref[c, n]
    lse = plgpu.load(lse_ref.at[jnp.maximum(g, 0), rows], mask=row_ok, other=-jnp.inf)
    return jnp.maximum(g, 0), jnp.where(g >= 0, lse, -jnp.inf)

  m = lax.fori_loop(0, num_partials, lambda n, m: jnp.maximum(m, partial_lse(n)[1]),
                    jnp.full((block_m,), -jnp.inf, jnp.float32))
  m = jnp.where(m == -jnp.inf, 0.0, m)

  def accumulate(n, carry):
    acc, w_sum = carry
    g, lse = partial_lse(n)
    w = jnp.exp2(lse - m)
    o = plgpu.load(o_ref.at[g, rows, cols], mask=row_ok[:, None], other=0.0)
    return acc + w[:, None] * o, w_sum + w

  acc, w_sum = lax.fori_loop(0, num_partials, accumulate,
                             (jnp.zeros((block_m, block_r), jnp.float32), jnp.zeros((block_m,), jnp.float32)))
  plgpu.store(out_ref.at[c, rows, cols], (acc / jnp.where(w_sum > 0, w_sum, 1.0)[:, None]).astype(out_ref.dtype),
              mask=row_ok[:, None])


def _tiles(C, M, R, target_programs):
  """(block_m, block_r): the largest tile (rows first, 8 to 32; columns 64 to 128) that still gives
  target_programs programs, else the smallest."""
  for block_m, block_r in ((32, 128), (16, 128), (16, 64), (8, 64)):
    if C * pl.cdiv(M, block_m) * pl.cdiv(R, block_r) >= target_programs:
      break
  return block_m, min(block_r, R)


@functools.partial(jax.jit, static_argnames=["out_dtype", "interpret"])
def merge_partials(o_GMR, lse_GM, groups_CN, *, out_dtype=jnp.float32, interpret: bool = False):
  """The merge of `merge_reference` on the GPU (Pallas-Triton; `interpret` runs it on the CPU). groups_CN:
  int32 [C, N] (`group_index`); R a power of two."""
  G, M, R = o_GMR.shape
  C, N = groups_CN.shape
  if lse_GM.shape != (G, M) or o_GMR.dtype != jnp.float32 or lse_GM.dtype != jnp.float32:
    raise ValueError(f"o must be float32 [G, M, R] and lse float32 [G, M] = [{G}, {M}], "
                     f"got {o_GMR.dtype}{o_GMR.shape} and {lse_GM.dtype}{lse_GM.shape}")
  if R < 16 or R & (R - 1) or N < 1:
    raise ValueError(f"R ({R}) must be a power of two >= 16 and groups [C, N] have N >= 1, got {groups_CN.shape}")
  block_m, block_r = _tiles(C, M, R, 2 * 132)  # two programs an H200 SM
  return pl.pallas_call(
      functools.partial(_merge_kernel, num_rows=M, num_partials=N, block_m=block_m, block_r=block_r),
      grid=(C, pl.cdiv(M, block_m), R // block_r),
      out_shape=jax.ShapeDtypeStruct((C, M, R), out_dtype),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3), interpret=interpret, name="lse_merge",
  )(groups_CN.astype(jnp.int32), lse_GM, o_GMR)
