"""Tree-masked absorbed-MLA attention for decode (T = 1) and DDTree verify (T = B + 1).

Each query row (sequence c, tree token t, head h) attends over
  * the cached prefix: rows [0, prefix_len[c]) of the latent cache [C, S_max, R + P], and
  * the tree tail: the step's own rows tail[c, u] for every u with visibility[c, t, u].
A key row holds the normalised latent c_kv (first R values) and the roped key k_rope (last P values).
score = (q_lat . c_kv + q_rope . k_rope) * scale; the latent is also the value: o_lat = sum_s p_s c_kv_s.
K2.6 uses R = 512, P = 64; W_UK / W_UV are applied outside.

Kernel layout: the T*H query rows of a sequence form the M dimension, so one tile of
block_m (token, head) rows shares every key block and the dots run on tensor cores. The prefix
kernel splits each sequence's prefix into `num_splits` ranges (flash-decoding); the tail kernel
attends over the tree rows under the ancestor mask. Each program writes a normalised partial output
and its base-2 log-sum-exp; an exact log-sum-exp merge in XLA combines them.
Two backends: the Pallas-Triton prefix and tail kernels below, and a warp-specialised Pallas Mosaic GPU
kernel (`mla_prefix_mosaic.py`) that does the prefix splits, as groups of key blocks laid out over the whole
batch by a split plan (`mla_splits.plan_splits`), and, in each sequence's last group, the tail. It does not
repeat the score MMA in both warpgroups and is the default on Hopper where it fits (`mosaic_prefix_fits`).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import arch, mla_prefix_mosaic
from pallas_kernels.mla_splits import choose_num_splits, equal_plan, partial_slots, plan_splits, sequence_groups

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
        raise ValueError(
            f"visibility must be bool [C, T, T] = [{C}, {T}, {T}], got {visibility.dtype}{visibility.shape}"
        )
    return C, T, H, R, P


def _check_layer(cache, layer):
    """The cache one layer of which is read: [C, S_max, R + P] itself (layer None) or, for a traced or static
    layer index, layer `layer` of the stack [L, C, S_max, R + P] (returned as an abstract [C, S_max, R + P])."""
    if layer is None:
        return cache
    if cache.ndim != 4:
        raise ValueError(f"with layer=, cache must be the stack [L, C, S_max, R + P], got shape {cache.shape}")
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar, got {jnp.result_type(layer)}{jnp.shape(layer)}")
    return jax.ShapeDtypeStruct(cache.shape[1:], cache.dtype)


def _cache_rows(cache, layer, C):
    """(cache as [L*C, S_max, R + P] -- a free reshape, no copy of the layer --, the row of sequence c [C] int32).
    A slice of the stack in front of the kernel's custom call would copy the layer's whole cache every layer."""
    if layer is None:
        return cache, jnp.arange(C, dtype=jnp.int32)
    L, _, S_max, D = cache.shape
    return cache.reshape(L * C, S_max, D), jnp.asarray(layer, jnp.int32) * C + jnp.arange(C, dtype=jnp.int32)


def tree_mla_attention_reference(q_lat, q_rope, cache, prefix_len, tail, visibility, *, scale: float, layer=None):
    """Plain-jnp tree MLA attention.

    Args:
      q_lat: [C, T, H, R] absorbed queries (q_nope @ W_UK).
      q_rope: [C, T, H, P] roped queries.
      cache: [C, S_max, R + P] latent cache rows (c_kv, then k_rope).
      prefix_len: [C] int, number of valid cache rows per sequence.
      tail: [C, T, R + P] the tree tokens' own latent rows.
      visibility: [C, T, T] bool, visibility[c, t, u]: tree token t sees tail row u.
      scale: softmax scale (including the YaRN mscale).
      layer: None, or an integer scalar (may be traced): cache is then the stack [L, C, S_max, R + P] of every
        layer's cache and layer `layer` is read.
    Returns:
      o_lat [C, T, H, R] in q_lat.dtype; scores, softmax and sums in float32. A row that sees nothing is 0.
    """
    C, T, H, R, P = _check_args(q_lat, q_rope, _check_layer(cache, layer), prefix_len, tail, visibility)
    if layer is not None:
        cache = lax.dynamic_index_in_dim(cache, layer, axis=0, keepdims=False)
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
        [jnp.broadcast_to(prefix_visible_CS[:, None, :], (C, T, cache.shape[1])), visibility], axis=-1
    )
    visible_CT1S = visible_CTS[:, :, None, :]
    s_CTHS = jnp.where(visible_CT1S, s_CTHS, -jnp.inf)
    m_CTH = jnp.max(s_CTHS, axis=-1, keepdims=True)
    m_CTH = jnp.where(jnp.isfinite(m_CTH), m_CTH, 0.0)
    p_CTHS = jnp.where(visible_CT1S, jnp.exp(s_CTHS - m_CTH), 0.0)
    l_CTH = jnp.sum(p_CTHS, axis=-1, keepdims=True)
    p_CTHS = p_CTHS / jnp.where(l_CTH > 0, l_CTH, 1.0)
    o_CTHR = jnp.einsum("cths,csr->cthr", p_CTHS[..., : cache.shape[1]], cache[..., :R], precision=hi)
    o_CTHR += jnp.einsum("cths,csr->cthr", p_CTHS[..., cache.shape[1] :], tail[..., :R], precision=hi)
    return o_CTHR.astype(out_dtype)


def _load_rows(ref, c, row_slice, row_ok, lat_dim, rope_dim, block_r):
    """Rows row_slice of ref[c] as block_r-wide latent chunks and the rope part (zeros where not row_ok).

    ref is [C, rows, R + P] (cache, tail) or a pair of [C, rows, R] / [C, rows, P] refs (queries)."""
    lat_ref, rope_ref, rope_start = (ref, ref, lat_dim) if not isinstance(ref, tuple) else (*ref, 0)
    load = lambda r, start, width: plgpu.load(r.at[c, row_slice, pl.ds(start, width)], mask=row_ok[:, None], other=0)
    return tuple(load(lat_ref, j, block_r) for j in range(0, lat_dim, block_r)), load(rope_ref, rope_start, rope_dim)


def _attend_block(queries, keys, visible, carry, qk_scale):
    """One online-softmax step (base 2) of block_m query rows over one key block.

    queries / keys: (latent chunks [n, block_r] ..., rope [n, P]); visible: [block_m, block_k] bool;
    carry: (accumulator chunks [block_m, block_r] ..., running max [block_m], running sum [block_m]).
    The latent is handled in block_r-wide chunks (256 wide for 64-row tiles: see `tree_mla_attention`)."""
    (q_chunks, q_rope), (k_chunks, k_rope), (acc_chunks, m_prev, l_prev) = queries, keys, carry
    s = jnp.dot(q_rope, k_rope.T, preferred_element_type=jnp.float32)
    for q_chunk, k_chunk in zip(q_chunks, k_chunks):
        s += jnp.dot(q_chunk, k_chunk.T, preferred_element_type=jnp.float32)
    s = jnp.where(visible, s * qk_scale, -jnp.inf)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows that have seen nothing yet
    correction = jnp.exp2(m_prev - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    l_next = l_prev * correction + p.sum(axis=1)
    p = p.astype(k_chunks[0].dtype)
    acc_chunks = tuple(
        acc * correction[:, None] + jnp.dot(p, k_chunk, preferred_element_type=jnp.float32)
        for acc, k_chunk in zip(acc_chunks, k_chunks)
    )
    return acc_chunks, m_next, l_next


def _empty_carry(block_m, lat_dim, block_r):
    return (
        tuple(jnp.zeros((block_m, block_r), jnp.float32) for _ in range(lat_dim // block_r)),
        jnp.full((block_m,), -jnp.inf, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
    )


def _store_partial(o_ref, lse_ref, index, row_slice, row_ok, carry, block_r):
    """o_ref[*index, rows] = acc / l (0 where nothing was seen); lse_ref[*index, rows] = m + log2 l (or -inf)."""
    acc_chunks, m, l = carry
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    for j, acc in enumerate(acc_chunks):
        plgpu.store(
            o_ref.at[(*index, row_slice, pl.ds(j * block_r, block_r))], acc / l_safe[:, None], mask=row_ok[:, None]
        )
    plgpu.store(lse_ref.at[(*index, row_slice)], jnp.where(seen, m + jnp.log2(l_safe), -jnp.inf), mask=row_ok)


def _prefix_kernel(
    prefix_len_ref,
    cache_seq_ref,
    q_lat_ref,
    q_rope_ref,
    cache_ref,  # inputs
    o_ref,
    lse_ref,  # outputs
    *,
    num_rows,
    num_splits,
    block_m,
    block_k,
    block_r,
    qk_scale,
):
    """Grid (m block, split, c). prefix_len [C]; cache_seq [C]: cache row of sequence c; q_lat [C, M, R],
    q_rope [C, M, P] (row = t * H + h); cache [rows, S_max, R+P] -> o [C, num_splits, M, R] float32,
    lse [C, num_splits, M] float32."""
    lat_dim, rope_dim = q_lat_ref.shape[2], q_rope_ref.shape[2]
    m_blk, split, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    row_slice = pl.ds(m_blk * block_m, block_m)
    row_ok = m_blk * block_m + jnp.arange(block_m) < num_rows
    queries = _load_rows((q_lat_ref, q_rope_ref), c, row_slice, row_ok, lat_dim, rope_dim, block_r)
    prefix_len = prefix_len_ref[c]
    num_blocks = pl.cdiv(prefix_len, block_k)
    blocks_per_split = pl.cdiv(num_blocks, num_splits)
    first = split * blocks_per_split

    def body(i, carry):
        start = (first + i) * block_k
        key_ok = start + jnp.arange(block_k) < prefix_len
        keys = _load_rows(cache_ref, cache_seq_ref[c], pl.ds(start, block_k), key_ok, lat_dim, rope_dim, block_r)
        return _attend_block(queries, keys, key_ok[None, :], carry, qk_scale)

    carry = lax.fori_loop(
        0, jnp.clip(num_blocks - first, 0, blocks_per_split), body, _empty_carry(block_m, lat_dim, block_r)
    )
    _store_partial(o_ref, lse_ref, (c, split), row_slice, row_ok, carry, block_r)


def _tail_kernel(
    q_lat_ref,
    q_rope_ref,
    tail_ref,
    vis_ref,  # inputs
    o_ref,
    lse_ref,  # outputs
    *,
    num_heads,
    num_tokens,
    block_m,
    block_t,
    block_r,
    qk_scale,
):
    """Grid (m block, c). q_lat [C, M, R], q_rope [C, M, P]; tail [C, T, R+P]; vis [C, T*T] (flattened
    visibility) -> o [C, M, R] float32, lse [C, M] float32."""
    lat_dim, rope_dim = q_lat_ref.shape[2], q_rope_ref.shape[2]
    m_blk, c = pl.program_id(0), pl.program_id(1)
    rows = m_blk * block_m + jnp.arange(block_m)
    row_slice, row_ok = pl.ds(m_blk * block_m, block_m), rows < num_tokens * num_heads
    queries = _load_rows((q_lat_ref, q_rope_ref), c, row_slice, row_ok, lat_dim, rope_dim, block_r)
    token = rows // num_heads

    def body(i, carry):
        u = i * block_t + jnp.arange(block_t)
        u_ok = u < num_tokens
        keys = _load_rows(tail_ref, c, pl.ds(i * block_t, block_t), u_ok, lat_dim, rope_dim, block_r)
        visible = plgpu.load(
            vis_ref.at[c, token[:, None] * num_tokens + u[None, :]], mask=row_ok[:, None] & u_ok[None, :], other=False
        )
        return _attend_block(queries, keys, visible, carry, qk_scale)

    carry = lax.fori_loop(0, pl.cdiv(num_tokens, block_t), body, _empty_carry(block_m, lat_dim, block_r))
    _store_partial(o_ref, lse_ref, (c,), row_slice, row_ok, carry, block_r)


def _merge_partials(o_CNMR, lse_CNM, o_tail_CMR=None, lse_tail_CM=None):
    """Exact log-sum-exp (base 2) merge of N normalised partial outputs and an optional tail partial
    -> [C, M, R] float32. A single partial is the output itself."""
    if o_tail_CMR is None and o_CNMR.shape[1] == 1:
        return o_CNMR[:, 0]
    m_CM = jnp.max(lse_CNM, axis=1)
    if lse_tail_CM is not None:
        m_CM = jnp.maximum(m_CM, lse_tail_CM)
    m_CM = jnp.where(jnp.isfinite(m_CM), m_CM, 0.0)
    w_CNM = jnp.exp2(lse_CNM - m_CM[:, None])
    w_sum_CM = jnp.sum(w_CNM, axis=1)
    o_CMR = jnp.sum(w_CNM[..., None] * o_CNMR, axis=1)
    if o_tail_CMR is not None:
        w_tail_CM = jnp.exp2(lse_tail_CM - m_CM)
        w_sum_CM += w_tail_CM
        o_CMR += w_tail_CM[..., None] * o_tail_CMR
    return o_CMR / jnp.where(w_sum_CM > 0, w_sum_CM, 1.0)[..., None]


def _pow2_at_least(n):
    return 1 << max(0, (n - 1).bit_length())


def mosaic_tiles(M, S_max, T):
    """(query row tiles, cache key blocks, tail key blocks) of `mla_prefix_mosaic` for a sequence of M query rows,
    S_max cache rows and T tail rows."""
    block_m, block_k = mla_prefix_mosaic.BLOCK_M, mla_prefix_mosaic.BLOCK_K
    return pl.cdiv(M, block_m), pl.cdiv(S_max, block_k), pl.cdiv(T, block_k)


def mosaic_plan(C, M, S_max, T):
    """`plan_splits` for `mla_prefix_mosaic`'s tiles: C sequences of M query rows, S_max cache rows and T tail
    rows each."""
    num_m_blocks, num_key_blocks, num_tail_blocks = mosaic_tiles(M, S_max, T)
    return plan_splits(num_m_blocks, C, num_key_blocks, num_tail_blocks, _NUM_SMS)


def merge_groups(o_GMR, lse_GM, plan, num_seqs):
    """[C, M, R] float32: each sequence's partials merged, read where the kernel writes them (`partial_slots`:
    sequence after sequence). With one group count for every sequence that is a reshape; otherwise sequences with
    the same count are merged together (their runs gathered into [C_n, n, ...]) and put back in order."""
    groups = sequence_groups(plan, num_seqs)
    counts = [len(gs) for gs in groups]
    if len(set(counts)) == 1:
        return _merge_partials(
            o_GMR.reshape(num_seqs, counts[0], *o_GMR.shape[1:]), lse_GM.reshape(num_seqs, counts[0], -1)
        )
    slots = partial_slots(plan, num_seqs)
    merged, order = [], []
    for count in sorted(set(counts)):
        seqs = [seq for seq in range(num_seqs) if counts[seq] == count]
        index = np.asarray([slots[groups[seq]] for seq in seqs])
        merged.append(_merge_partials(o_GMR[index], lse_GM[index]))
        order += seqs
    return jnp.concatenate(merged)[np.argsort(order)]


PREFIX_KERNELS = ("auto", "triton", "mosaic")


def mosaic_prefix_fits(q_lat, cache):
    """Whether `mla_prefix_mosaic` takes this shape: bf16, (R, P) = (512, 64), S_max a multiple of 8 (its TMA
    tiling). "auto" also wants more than 16 query rows a sequence: below that Triton's 16-row tiles are faster."""
    C, T, H, R = q_lat.shape
    return (
        q_lat.dtype == jnp.bfloat16
        and cache.dtype == jnp.bfloat16
        and cache.shape[1] % 8 == 0
        and (R, cache.shape[2] - R) == (mla_prefix_mosaic.LAT_DIM, mla_prefix_mosaic.ROPE_DIM)
    )


def _mosaic_attention(
    q_lat_CMR,
    q_rope_CMP,
    cache,
    cache_seq,
    prefix_len,
    tail,
    visibility,
    *,
    num_splits,
    qk_scale,
    interpret,
    prefix_attention=mla_prefix_mosaic.mla_prefix_attention,
):
    """(o [G, M, R], lse [G, M], plan): the partials of the plan's groups from `mla_prefix_mosaic` (64-row tiles,
    64-key blocks, one CTA an SM; a sequence's last group also attends to the tail), under `mosaic_plan` or
    num_splits equal splits a sequence. prefix_attention: the kernel (scripts race other versions of it)."""
    C, M, _ = q_lat_CMR.shape
    T = tail.shape[1]
    plan = (
        equal_plan(num_splits, C, mosaic_tiles(M, cache.shape[1], T)[1])
        if num_splits
        else mosaic_plan(C, M, cache.shape[1], T)
    )
    tail_visible_CMT = jnp.repeat(visibility, M // T, axis=1)  # row t * H + h: token t
    o, lse = prefix_attention(
        q_lat_CMR,
        q_rope_CMP,
        cache,
        prefix_len,
        tail,
        tail_visible_CMT,
        plan=plan,
        qk_scale=qk_scale,
        cache_seq=cache_seq,
        interpret=interpret,
    )
    return o, lse, plan


@functools.partial(
    jax.jit,
    static_argnames=[
        "scale",
        "block_m",
        "block_k",
        "block_r",
        "num_splits",
        "num_warps",
        "num_stages",
        "prefix_kernel",
        "interpret",
    ],
)
def tree_mla_attention(
    q_lat,
    q_rope,
    cache,
    prefix_len,
    tail,
    visibility,
    *,
    scale: float,
    block_m: int = 64,
    block_k: int = 64,
    block_r: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    prefix_kernel: str = "auto",
    layer=None,
    interpret: bool = False,
):
    """Tree MLA attention on the GPU (Pallas-Triton or Mosaic GPU prefix kernel); arguments and result as in
    `tree_mla_attention_reference`.
    With `layer`, the kernels read that layer inside the whole cache stack (no per-layer copy).

    Knobs: block_m query rows (tree token x head) per tile, clamped to T*H (at least 16); block_k
    prefix keys per step; block_r width of the latent chunks (default 256 for 64-row tiles, else R);
    num_splits prefix ranges per sequence (default: Mosaic `mosaic_plan`, a split plan over the batch;
    Triton `choose_num_splits`, with one program per SM resident for 64-row tiles and two for 16-row tiles, and
    16-row tiles split down to one key block a split);
    num_warps (default 8 for block_m >= 64, else 4) and num_stages for Triton. prefix_kernel: "triton" (the
    kernel below), "mosaic" (`mla_prefix_mosaic`, warp-specialised; see `mosaic_prefix_fits`; block_m / block_k /
    block_r / warps / stages do not apply)
    or "auto": mosaic where it fits, T*H > 16 and the GPU is a Hopper (`arch.has_wgmma`), else triton.
    The Triton defaults (block_k 64, 2 stages, 256-wide latent chunks for 64-row tiles, the whole latent for
    16-row tiles) were tuned on the H200.
    """
    C, T, H, R, P = _check_args(q_lat, q_rope, _check_layer(cache, layer), prefix_len, tail, visibility)
    cache, cache_seq = _cache_rows(cache, layer, C)
    M, S_max = T * H, cache.shape[1]
    block_m = min(block_m, max(16, _pow2_at_least(M)))
    block_r = min(R, block_r or (256 if block_m >= 64 else R))
    for name, n in (("block_m", block_m), ("block_k", block_k), ("block_r", block_r)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {n}")
    num_m_blocks = pl.cdiv(M, block_m)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if prefix_kernel not in PREFIX_KERNELS:
        raise ValueError(f"prefix_kernel must be one of {PREFIX_KERNELS}, got {prefix_kernel!r}")
    params = plgpu.CompilerParams(num_warps=num_warps or (8 if block_m >= 64 else 4), num_stages=num_stages)
    q_lat_CMR, q_rope_CMP = q_lat.reshape(C, M, R), q_rope.reshape(C, M, P)
    qk_scale = scale * _LOG2E

    if prefix_kernel == "auto":
        prefix_kernel = "mosaic" if mosaic_prefix_fits(q_lat, cache) and M > 16 and arch.has_wgmma() else "triton"
    if prefix_kernel == "mosaic":
        if not mosaic_prefix_fits(q_lat, cache):
            raise ValueError(
                f"prefix_kernel='mosaic' needs bf16 q and cache, (R, P) = (512, 64) and S_max % 8 == 0; "
                f"got q_lat {q_lat.dtype}{q_lat.shape}, cache {cache.dtype}{cache.shape}"
            )
        o_GMR, lse_GM, plan = _mosaic_attention(
            q_lat_CMR,
            q_rope_CMP,
            cache,
            cache_seq,
            prefix_len.astype(jnp.int32),
            tail,
            visibility,
            num_splits=num_splits,
            qk_scale=qk_scale,
            interpret=interpret,
        )
        return merge_groups(o_GMR, lse_GM, plan, C).reshape(C, T, H, R).astype(q_lat.dtype)
    if num_splits is None:
        wide = block_m >= 64
        resident = _NUM_SMS * (1 if wide else 2)  # 64-row tiles fill an SM's shared memory
        # 16-row tiles split down to one key block: where SMs are idle a program's latency is the call's, and their
        # partials (16 KB a split at 8 heads) cost the merge little
        num_splits = choose_num_splits(
            C * num_m_blocks, pl.cdiv(S_max, block_k), resident, min_split_blocks=4 if wide else 1
        )
    o_prefix, lse_prefix = pl.pallas_call(
        functools.partial(
            _prefix_kernel,
            num_rows=M,
            num_splits=num_splits,
            block_m=block_m,
            block_k=block_k,
            block_r=block_r,
            qk_scale=qk_scale,
        ),
        grid=(num_m_blocks, num_splits, C),
        out_shape=[
            jax.ShapeDtypeStruct((C, num_splits, M, R), jnp.float32),
            jax.ShapeDtypeStruct((C, num_splits, M), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="tree_mla_prefix",
    )(prefix_len.astype(jnp.int32), cache_seq, q_lat_CMR, q_rope_CMP, cache)
    o_tail, lse_tail = pl.pallas_call(
        functools.partial(
            _tail_kernel,
            num_heads=H,
            num_tokens=T,
            block_m=block_m,
            block_t=max(16, min(block_k, _pow2_at_least(T))),
            block_r=block_r,
            qk_scale=qk_scale,
        ),
        grid=(num_m_blocks, C),
        out_shape=[jax.ShapeDtypeStruct((C, M, R), jnp.float32), jax.ShapeDtypeStruct((C, M), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="tree_mla_tail",
    )(q_lat_CMR, q_rope_CMP, tail, visibility.reshape(C, T * T))
    return _merge_partials(o_prefix, lse_prefix, o_tail, lse_tail).reshape(C, T, H, R).astype(q_lat.dtype)
