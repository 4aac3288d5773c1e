"""Tree-masked absorbed-MLA attention for decode (T = 1) and DDTree verify (T = B + 1).

Each query row (sequence c, tree token t, head h) attends over
  * the cached prefix: rows [0, prefix_len[c]) of the latent cache [C, S_max, R + P], and
  * the tree tail: the step's own rows tail[c, u] for every u with visibility[c, t, u].
A key row holds the normalised latent c_kv (first R values) and the roped key k_rope (last P values).
score = (q_lat . c_kv + q_rope . k_rope) * scale; the latent is also the value: o_lat = sum_s p_s c_kv_s.
K2.6 uses R = 512, P = 64; W_UK / W_UV are applied outside.

Kernel layout (Pallas-Triton): the T*H query rows of a sequence form the M dimension, so one tile of
block_m (token, head) rows shares every key block and the two dots run on tensor cores. Grid axis 1
splits the prefix into `num_splits` ranges (flash-decoding); its last index handles the tree tail
under the ancestor mask. Each program writes a normalised partial output and its base-2
log-sum-exp; an exact log-sum-exp merge in XLA combines them. Optionally the value (latent)
columns are split into block_r-wide chunks on grid axis 0 to bound the fp32 accumulator.
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec

_LOG2E = math.log2(math.e)
_NUM_SMS = 132  # H200; sizes the default prefix split


def _check_args(q_lat, q_rope, cache, prefix_len, tail, visibility):
  """Validates shapes; returns (C, T, H, R, P)."""
  if q_lat.ndim != 4:
    raise ValueError(f"q_lat must be [C, T, H, R], got shape {q_lat.shape}")
  C, T, H, R = q_lat.shape
  if q_rope.ndim != 4 or q_rope.shape[:3] != (C, T, H):
    raise ValueError(f"q_rope must be [C, T, H, P] = [{C}, {T}, {H}, P], got {q_rope.shape}")
  P = q_rope.shape[3]
  for name, n in (("R (q_lat.shape[-1])", R), ("P (q_rope.shape[-1])", P)):
    if n < 1 or n & (n - 1):
      raise ValueError(f"{name} must be a power of two, got {n}")
  if cache.ndim != 3 or cache.shape[0] != C or cache.shape[2] != R + P:
    raise ValueError(f"cache must be [C, S_max, R + P] = [{C}, S_max, {R + P}], got {cache.shape}")
  if prefix_len.shape != (C,) or not jnp.issubdtype(prefix_len.dtype, jnp.integer):
    raise ValueError(f"prefix_len must be an integer [C] = [{C}] array, got {prefix_len.dtype}{prefix_len.shape}")
  if tail.shape != (C, T, R + P):
    raise ValueError(f"tail must be [C, T, R + P] = [{C}, {T}, {R + P}], got {tail.shape}")
  if visibility.shape != (C, T, T) or visibility.dtype != jnp.bool_:
    raise ValueError(f"visibility must be bool [C, T, T] = [{C}, {T}, {T}], got {visibility.dtype}{visibility.shape}")
  return C, T, H, R, P


def tree_mla_attention_reference(q_lat, q_rope, cache, prefix_len, tail, visibility, *, scale: float):
  """Plain-jnp tree MLA attention.

  Args:
    q_lat: [C, T, H, R] absorbed queries (q_nope @ W_UK).
    q_rope: [C, T, H, P] roped queries.
    cache: [C, S_max, R + P] latent cache rows (c_kv, then k_rope).
    prefix_len: [C] int, number of valid cache rows per sequence.
    tail: [C, T, R + P] the tree tokens' own latent rows.
    visibility: [C, T, T] bool, visibility[c, t, u]: tree token t sees tail row u.
    scale: softmax scale (including the YaRN mscale).
  Returns:
    o_lat [C, T, H, R] in q_lat.dtype; scores, softmax and sums in float32. A row that sees nothing is 0.
  """
  C, T, H, R, P = _check_args(q_lat, q_rope, cache, prefix_len, tail, visibility)
  f32, out_dtype = jnp.float32, q_lat.dtype
  q_lat, q_rope = q_lat.astype(f32), q_rope.astype(f32)
  cache, tail = cache.astype(f32), tail.astype(f32)
  hi = jax.lax.Precision.HIGHEST

  def scores(keys_CSD):  # -> [C, T, H, S]
    s = jnp.einsum("cthr,csr->cths", q_lat, keys_CSD[..., :R], precision=hi)
    s += jnp.einsum("cthp,csp->cths", q_rope, keys_CSD[..., R:], precision=hi)
    return s * scale

  prefix_visible_CS = jnp.arange(cache.shape[1])[None, :] < prefix_len[:, None]
  s_CTHS = jnp.concatenate([scores(cache), scores(tail)], axis=-1)
  visible_CTS = jnp.concatenate(
      [jnp.broadcast_to(prefix_visible_CS[:, None, :], (C, T, cache.shape[1])), visibility], axis=-1)
  visible_CT1S = visible_CTS[:, :, None, :]
  s_CTHS = jnp.where(visible_CT1S, s_CTHS, -jnp.inf)
  m_CTH = jnp.max(s_CTHS, axis=-1, keepdims=True)
  m_CTH = jnp.where(jnp.isfinite(m_CTH), m_CTH, 0.0)
  p_CTHS = jnp.where(visible_CT1S, jnp.exp(s_CTHS - m_CTH), 0.0)
  l_CTH = jnp.sum(p_CTHS, axis=-1, keepdims=True)
  p_CTHS = p_CTHS / jnp.where(l_CTH > 0, l_CTH, 1.0)
  o_CTHR = jnp.einsum("cths,csr->cthr", p_CTHS[..., :cache.shape[1]], cache[..., :R], precision=hi)
  o_CTHR += jnp.einsum("cths,csr->cthr", p_CTHS[..., cache.shape[1]:], tail[..., :R], precision=hi)
  return o_CTHR.astype(out_dtype)


def _attend_block(q_lat, q_rope, k_lat, k_rope, value, visible, carry, qk_scale):
  """One online-softmax step (base 2) of block_m query rows over one key block."""
  acc, m_prev, l_prev = carry
  s = jnp.dot(q_lat, k_lat.T, preferred_element_type=jnp.float32)
  s += jnp.dot(q_rope, k_rope.T, preferred_element_type=jnp.float32)
  s = jnp.where(visible, s * qk_scale, -jnp.inf)
  m_next = jnp.maximum(m_prev, s.max(axis=1))
  m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows that have seen nothing yet
  correction = jnp.exp2(m_prev - m_safe)
  p = jnp.exp2(s - m_safe[:, None])
  l_next = l_prev * correction + p.sum(axis=1)
  acc = acc * correction[:, None] + jnp.dot(p.astype(value.dtype), value, preferred_element_type=jnp.float32)
  return acc, m_next, l_next


def _tree_mla_kernel(prefix_len_ref, q_lat_ref, q_rope_ref, cache_ref, tail_ref, vis_ref,  # inputs
                     o_ref, lse_ref,  # outputs
                     *, num_heads, num_tokens, num_splits, block_m, block_k, block_t, block_r, qk_scale):
  """Refs: prefix_len [C]; q_lat [C, M, R]; q_rope [C, M, P] (row = t * H + h); cache [C, S_max, R+P];
  tail [C, T, R+P]; vis [C, T*T] (flattened visibility). Outputs: o [C, num_splits+1, M, R] float32,
  lse [C, num_splits+1, M] float32 (base 2; -inf for a row that saw nothing in this split)."""
  lat_dim, rope_dim = q_lat_ref.shape[2], q_rope_ref.shape[2]
  num_r_chunks = lat_dim // block_r
  m_blk, r_blk = pl.program_id(0) // num_r_chunks, pl.program_id(0) % num_r_chunks
  split, c = pl.program_id(1), pl.program_id(2)
  rows = m_blk * block_m + jnp.arange(block_m)
  row_ok = rows < num_tokens * num_heads
  row_slice = pl.ds(m_blk * block_m, block_m)
  q_lat = plgpu.load(q_lat_ref.at[c, row_slice, :], mask=row_ok[:, None], other=0)
  q_rope = plgpu.load(q_rope_ref.at[c, row_slice, :], mask=row_ok[:, None], other=0)

  def load_keys(keys_ref, key_slice, key_ok):
    """[block, R], [block, P] and the value columns [block, block_r] of rows key_slice of keys_ref[c]."""
    load = lambda cols: plgpu.load(keys_ref.at[c, key_slice, cols], mask=key_ok[:, None], other=0)
    k_lat, k_rope = load(pl.ds(0, lat_dim)), load(pl.ds(lat_dim, rope_dim))
    value = k_lat if block_r == lat_dim else load(pl.ds(r_blk * block_r, block_r))
    return k_lat, k_rope, value

  init = (jnp.zeros((block_m, block_r), jnp.float32), jnp.full((block_m,), -jnp.inf, jnp.float32),
          jnp.zeros((block_m,), jnp.float32))

  def prefix_part():
    prefix_len = prefix_len_ref[c]
    num_blocks = pl.cdiv(prefix_len, block_k)
    blocks_per_split = pl.cdiv(num_blocks, num_splits)
    first = split * blocks_per_split

    def body(i, carry):
      start = (first + i) * block_k
      key_ok = start + jnp.arange(block_k) < prefix_len
      keys = load_keys(cache_ref, pl.ds(start, block_k), key_ok)
      return _attend_block(q_lat, q_rope, *keys, key_ok[None, :], carry, qk_scale)

    return lax.fori_loop(0, jnp.clip(num_blocks - first, 0, blocks_per_split), body, init)

  def tail_part():
    token = rows // num_heads

    def body(i, carry):
      u = i * block_t + jnp.arange(block_t)
      u_ok = u < num_tokens
      keys = load_keys(tail_ref, pl.ds(i * block_t, block_t), u_ok)
      visible = plgpu.load(vis_ref.at[c, token[:, None] * num_tokens + u[None, :]],
                           mask=row_ok[:, None] & u_ok[None, :], other=False)
      return _attend_block(q_lat, q_rope, *keys, visible, carry, qk_scale)

    return lax.fori_loop(0, pl.cdiv(num_tokens, block_t), body, init)

  acc, m, l = lax.cond(split < num_splits, prefix_part, tail_part)
  seen = l > 0
  o = acc / jnp.where(seen, l, 1.0)[:, None]
  plgpu.store(o_ref.at[c, split, row_slice, pl.ds(r_blk * block_r, block_r)], o, mask=row_ok[:, None])
  plgpu.store(lse_ref.at[c, split, row_slice], jnp.where(seen, m + jnp.log2(jnp.where(seen, l, 1.0)), -jnp.inf),
              mask=row_ok & (r_blk == 0))


def _merge_splits(o_CNMR, lse_CNM):
  """Exact log-sum-exp (base 2) merge of normalised partial outputs over axis 1 -> [C, M, R] float32."""
  m_CM = jnp.max(lse_CNM, axis=1)
  m_CM = jnp.where(jnp.isfinite(m_CM), m_CM, 0.0)
  w_CNM = jnp.exp2(lse_CNM - m_CM[:, None])
  w_sum_CM = jnp.sum(w_CNM, axis=1)
  o_CMR = jnp.einsum("cnm,cnmr->cmr", w_CNM, o_CNMR, precision=lax.Precision.HIGHEST)
  return o_CMR / jnp.where(w_sum_CM > 0, w_sum_CM, 1.0)[..., None]


def _pow2_at_least(n):
  return 1 << max(0, (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=["scale", "block_m", "block_k", "block_r", "num_splits", "num_warps",
                                             "num_stages", "interpret"])
def tree_mla_attention(q_lat, q_rope, cache, prefix_len, tail, visibility, *, scale: float, block_m: int = 64,
                       block_k: int = 32, block_r: int | None = None, num_splits: int | None = None,
                       num_warps: int | None = None, num_stages: int = 2, interpret: bool = False):
  """Pallas-Triton tree MLA attention; arguments and result as in `tree_mla_attention_reference`.

  Knobs: block_m query rows (tree token x head) per tile; block_k prefix keys per step; block_r value
  columns per program (default R: no value split); num_splits prefix ranges per sequence (default:
  about one wave of programs); num_warps (default 8 for 64x256+ accumulators, else 4) / num_stages
  for Triton. block_m is clamped to the row count T*H (at least 16).
  """
  C, T, H, R, P = _check_args(q_lat, q_rope, cache, prefix_len, tail, visibility)
  block_r = R if block_r is None else block_r
  for name, n in (("block_m", block_m), ("block_k", block_k), ("block_r", block_r)):
    if n < 16 or n & (n - 1):
      raise ValueError(f"{name} must be a power of two >= 16, got {n}")
  if block_r > R:
    raise ValueError(f"block_r must be <= R = {R}, got {block_r}")
  M, S_max = T * H, cache.shape[1]
  block_m = min(block_m, max(16, _pow2_at_least(M)))
  if num_warps is None:
    num_warps = 8 if block_m * block_r >= 64 * 256 else 4
  num_m_blocks, num_r_chunks = pl.cdiv(M, block_m), R // block_r
  if num_splits is None:
    num_splits = max(1, min(pl.cdiv(_NUM_SMS, C * num_m_blocks * num_r_chunks), pl.cdiv(S_max, 4 * block_k)))
  if num_splits < 1:
    raise ValueError(f"num_splits must be >= 1, got {num_splits}")
  block_t = max(16, min(block_k, _pow2_at_least(T)))

  kernel = functools.partial(
      _tree_mla_kernel, num_heads=H, num_tokens=T, num_splits=num_splits, block_m=block_m, block_k=block_k,
      block_t=block_t, block_r=block_r, qk_scale=scale * _LOG2E)
  o_CNMR, lse_CNM = pl.pallas_call(
      kernel,
      grid=(num_m_blocks * num_r_chunks, num_splits + 1, C),
      out_shape=[jax.ShapeDtypeStruct((C, num_splits + 1, M, R), jnp.float32),
                 jax.ShapeDtypeStruct((C, num_splits + 1, M), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="tree_mla_attention",
  )(prefix_len.astype(jnp.int32), q_lat.reshape(C, M, R), q_rope.reshape(C, M, P), cache, tail,
    visibility.reshape(C, T * T))
  return _merge_splits(o_CNMR, lse_CNM).reshape(C, T, H, R).astype(q_lat.dtype)


def tree_mla_attention_sharded(mesh, *, axis: str = "model", impl: str = "pallas", interpret: bool = False,
                               **block_knobs):
  """Returns f(q_lat, q_rope, cache, prefix_len, tail, visibility, *, scale) with heads sharded over
  mesh axis `axis` (shard_map); the latent cache, tail, lengths and visibility are replicated."""
  if impl == "pallas":
    attention = functools.partial(tree_mla_attention, interpret=interpret, **block_knobs)
  elif impl == "reference":
    if block_knobs:
      raise ValueError(f"block knobs {sorted(block_knobs)} apply only to impl='pallas'")
    attention = tree_mla_attention_reference
  else:
    raise ValueError(f"impl must be 'pallas' or 'reference', got {impl!r}")
  if axis not in mesh.axis_names:
    raise ValueError(f"axis {axis!r} is not a mesh axis {mesh.axis_names}")
  heads = PartitionSpec(None, None, axis, None)
  replicated = PartitionSpec()

  def sharded_attention(q_lat, q_rope, cache, prefix_len, tail, visibility, *, scale: float):
    if q_lat.ndim != 4 or q_lat.shape[2] % mesh.shape[axis]:
      raise ValueError(f"q_lat heads (shape {q_lat.shape}) must divide over {mesh.shape[axis]} devices of {axis!r}")
    return jax.shard_map(
        functools.partial(attention, scale=scale), mesh=mesh,
        in_specs=(heads, heads, replicated, replicated, replicated, replicated), out_specs=heads,
        check_vma=False)(q_lat, q_rope, cache, prefix_len, tail, visibility)

  return sharded_attention
