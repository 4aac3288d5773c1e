"""Tree-masked absorbed-MLA attention for decode (T = 1) and DDTree verify (T = B + 1).

Each query row (sequence c, tree token t, head h) attends over
  * the cached prefix: rows [0, prefix_len[c]) of the latent cache [C, S_max, R + P], and
  * the tree tail: the step's own rows tail[c, u] for every u with visibility[c, t, u].
A key row holds the normalised latent c_kv (first R values) and the roped key k_rope (last P values).
score = (q_lat . c_kv + q_rope . k_rope) * scale; the latent is also the value: o_lat = sum_s p_s c_kv_s.
K2.6 uses R = 512, P = 64; W_UK / W_UV are applied outside.
"""
import jax
import jax.numpy as jnp


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
