"""Tree MLA attention as a warp-specialised Mosaic GPU kernel (Hopper, bf16): the prefix splits, the last of
which also takes the tree tail.

The prefix of each sequence is cut into groups of key blocks by a split plan (mla_splits: `check_plan`,
`plan_splits`). For each group and 64-row tile of its sequence's T*H query rows, attend over the group's cache
rows (and, in the sequence's last group, over the tail rows each query row sees) and write the normalised partial
output and its base-2 log-sum-exp, at the group's slot (`mla_splits.partial_slots`: sequence after sequence, so a
sequence's partials are contiguous); `tree_mla_attention` merges a sequence's groups (nothing to merge with one).
Doing the tail here instead of in a second kernel saves its launch, its partial output and a merge operand.

Why a second backend: with a 576-wide key and a 512-wide value a 64-row tile needs a 64 x 512 fp32
accumulator, so two warpgroups must share the rows and split the value columns. Triton then makes both
warpgroups compute the whole score tile (1664 MMA units per key and row for 1088 useful). Here the warpgroups
split the keys instead and trade the row maxima and the bf16 probabilities through shared memory (FlashMLA's
scheme), so no MMA is repeated:

  warpgroup w in {0, 1}, per 64-key block (keys k_w = rows 32w..32w+31 of the block):
    s_w = Q K[k_w]^T            [64, 32]   (K = 576)
    m   = max(m, rowmax(s_0), rowmax(s_1))          (row maxima swapped in shared memory)
    P[:, k_w] = exp2(s_w - m)                      (bf16, shared memory)
    O_w = O_w * exp2(m_old - m) + P V[:, 256w:256w+256]   [64, 256]  (K = 64)
  warpgroup 2 streams Q once and the [64, 576] key blocks through a 2-stage TMA ring.
Each warpgroup keeps the running sum of its own keys' probabilities; the two are added at the end.
Tail blocks come from the tail rows (TMA reads zeros past the last); which of them a query row sees comes as one
32-bit word per row and half block (`tail_visibility_bits`), tested bit by bit against the key column.
Schedules that keep more live per warpgroup (whole blocks in turn, or key ranges balanced inside the key loop)
spill registers; balancing work across the batch is left to the split plan.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mla_splits import check_plan, partial_slots, sequence_groups
from pallas_kernels.mosaic_common import tiled_smem

BLOCK_M = 64  # query rows a CTA (the two compute warpgroups share them)
BLOCK_K = 64  # keys a pipeline step; each compute warpgroup scores half of them
STAGES = 2  # key blocks in flight: 2 x 72 KB of shared memory
LAT_DIM, ROPE_DIM = 512, 64
HALF_K, HALF_R = BLOCK_K // 2, LAT_DIM // 2
EPI_N = 64  # output columns a TMA store
_ROW = plgpu.Layout.WGMMA.reduce(1)


def group_table(plan, prefix_len, cache_seq, num_key_blocks, num_tail_blocks):
    """int32 [G, 7], a row per group of the plan: (sequence c, its cache row cache_seq[c], first key block, cache
    key blocks, tail key blocks, prefix keys from the first block on, its partial's slot) for the actual prefix
    lengths [C]. A planned block bound b of sequence c lands at floor(b * n_c / num_key_blocks),
    n_c = ceil(prefix_len[c] / BLOCK_K), so the groups split a shorter prefix in the planned proportions. The
    kernel reads these instead of computing them: each value it derives itself stays live across the key loop
    (spills)."""
    seq, first, end = (jnp.asarray(column, jnp.int32) for column in zip(*plan))
    tail_groups = [groups[-1] for groups in sequence_groups(plan, prefix_len.shape[0]) if groups]
    takes_tail = np.isin(np.arange(len(plan)), tail_groups)  # static, as the plan
    prefix_len = prefix_len.astype(jnp.int32)[seq]
    blocks = jnp.minimum(lax.div(prefix_len + BLOCK_K - 1, BLOCK_K), num_key_blocks)
    first, end = (lax.div(bound * blocks, max(num_key_blocks, 1)) for bound in (first, end))
    return jnp.stack(
        [
            seq,
            cache_seq.astype(jnp.int32)[seq],
            first,
            end - first,
            jnp.where(takes_tail, num_tail_blocks, 0),
            prefix_len - first * BLOCK_K,
            jnp.asarray(partial_slots(plan, prefix_len.shape[0])),
        ],
        axis=1,
    )


def pad_rows_for_tma(x):
    """x [C, rows, ...] with rows padded up to a multiple of 8 if it is more than 8 and no multiple: a TMA copy
    of a tiled buffer needs the global rows to be at most one 8-row tile or whole tiles (boxes past the last row
    read zeros and drop the stores)."""
    rows = x.shape[1]
    if rows <= 8 or rows % 8 == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, pl.cdiv(rows, 8) * 8 - rows)] + [(0, 0)] * (x.ndim - 2))


def tail_visibility_bits(tail_visible_CMT, num_rows):
    """bool [C, M, T] -> int32 [C, ceil(T / 32), num_rows]: bit j of word [c, b, r] is whether query row r sees
    tail row 32 b + j (query rows zero-padded to num_rows)."""
    C, M, T = tail_visible_CMT.shape
    num_words = pl.cdiv(T, 32)
    padded = jnp.pad(tail_visible_CMT, [(0, 0), (0, num_rows - M), (0, num_words * 32 - T)])
    bits = padded.reshape(C, num_rows, num_words, 32).astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32)
    words = jnp.sum(bits, axis=-1, dtype=jnp.uint32)  # disjoint bits: the sum is their OR
    return lax.bitcast_convert_type(words, jnp.int32).transpose(0, 2, 1)


def mla_prefix_reference(q_lat_CMR, q_rope_CMP, cache, prefix_len, tail, tail_visible_CMT, *, plan, qk_scale):
    """float32 partials. q_lat_CMR [C, M, 512], q_rope_CMP [C, M, 64]; cache [C, S_max, 576]; prefix_len [C];
    tail [C, T, 576]; tail_visible_CMT [C, M, T] bool: the tail rows each query row sees (in its sequence's last
    group only). qk_scale: softmax scale times log2(e). plan: see `mla_splits.check_plan` (key blocks of BLOCK_K rows).
    Returns o [G, M, 512] (normalised, 0 where a group saw nothing) and lse [G, M] (base 2, -inf where it saw
    nothing), one per group of the plan, at the group's `mla_splits.partial_slots` slot."""
    f32, hi = jnp.float32, lax.Precision.HIGHEST
    q_CMD = jnp.concatenate([q_lat_CMR, q_rope_CMP], axis=-1)
    C, M, _ = q_CMD.shape
    S_max = cache.shape[1]
    plan = check_plan(plan, C, pl.cdiv(S_max, BLOCK_K))
    seq, _, first, steps, tail_steps, _, _ = group_table(plan, prefix_len, jnp.arange(C), pl.cdiv(S_max, BLOCK_K), 1).T
    keys = jnp.concatenate([cache, tail], axis=1).astype(f32)[seq]
    s_GMK = jnp.einsum("gmd,gkd->gmk", q_CMD.astype(f32)[seq], keys, precision=hi) * qk_scale
    key_block = jnp.arange(S_max) // BLOCK_K
    in_group_GS = (
        (key_block >= first[:, None])
        & (key_block < (first + steps)[:, None])
        & (jnp.arange(S_max) < prefix_len[seq][:, None])
    )
    visible_GMK = jnp.concatenate(
        [
            jnp.broadcast_to(in_group_GS[:, None, :], (len(plan), M, S_max)),
            (tail_steps > 0)[:, None, None] & tail_visible_CMT[seq],
        ],
        axis=-1,
    )
    s_GMK = jnp.where(visible_GMK, s_GMK, -jnp.inf)
    m_GM = jnp.max(s_GMK, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m_GM), m_GM, 0.0)
    p_GMK = jnp.exp2(s_GMK - m_safe[..., None])
    l_GM = p_GMK.sum(-1)
    o = jnp.einsum("gmk,gkr->gmr", p_GMK, keys[..., :LAT_DIM], precision=hi)
    o = o / jnp.where(l_GM > 0, l_GM, 1.0)[..., None]
    lse = jnp.where(l_GM > 0, m_safe + jnp.log2(jnp.where(l_GM > 0, l_GM, 1.0)), -jnp.inf)
    group_at_slot = np.argsort(partial_slots(plan, C))
    return o[group_at_slot], lse[group_at_slot]


def _accumulate(acc, issue_dots, interpret):
    """acc + the wgmma dots that issue_dots(acc_ref) issues. On the GPU the dots accumulate into acc in place
    (run_state); Mosaic GPU's interpreter has no run_state, so there a fresh product is added."""
    if interpret:

        def product(acc_ref):
            issue_dots(acc_ref)
            return acc_ref[...]

        return acc + pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(issue_dots)(plgpu.ACC.init(acc))


def _kernel(
    group_ref,
    q_lat_ref,
    q_rope_ref,
    cache_ref,
    tail_ref,
    bits_ref,
    o_ref,
    lse_ref,
    q_and_out,
    kv_smem,
    p_smem,
    row_smem,
    q_bar,
    bits_bar,
    kv_bars,
    consumed_bars,
    row_bar,
    p_bar,
    *,
    num_tail,
    qk_scale,
    interpret,
):
    m_blk, group, wg = (lax.axis_index(n) for n in ("m", "group", "wg"))
    (q_lat_smem, q_rope_smem), (o_stage, lse_smem) = q_and_out
    bits_smem = row_smem.at[pl.ds(2, row_smem.shape[0] - 2)]  # the tail's visibility words, as float32 bits
    # TMA tiling needs the alignment proven; rows past M (the last tile) load as zeros and are not stored
    rows = pl.ds(pl.multiple_of(m_blk * BLOCK_M, BLOCK_M), BLOCK_M)
    c, seq, first, steps, tail_steps, prefix_keys = (group_ref[group, j] for j in range(6))  # see `group_table`
    total = steps + tail_steps  # key blocks [0, steps) come from the cache, then the tail's

    @pl.when(wg == 2)
    def _memory_warpgroup():
        plgpu.set_max_registers(40, action="decrease")

        def load_block(i, slot):  # each half of the block has its own buffer and barrier (no sliced MMA operands)
            for half in range(2):
                dst, bar = kv_smem.at[slot, half], kv_bars.at[slot * 2 + half]

                @pl.when(i < steps)
                def _():
                    start = pl.multiple_of((first + i) * BLOCK_K + half * HALF_K, HALF_K)
                    plgpu.copy_gmem_to_smem(cache_ref.at[seq, pl.ds(start, HALF_K)], dst, bar)

                @pl.when(i >= steps)
                def _():  # rows past the tail's T load as zeros (and are masked)
                    start = pl.multiple_of((i - steps) * BLOCK_K + half * HALF_K, HALF_K)
                    plgpu.copy_gmem_to_smem(tail_ref.at[c, pl.ds(start, HALF_K)], dst, bar)

        @pl.when(total > 0)
        def _():
            plgpu.copy_gmem_to_smem(q_lat_ref.at[c, rows], q_lat_smem, q_bar)
            plgpu.copy_gmem_to_smem(q_rope_ref.at[c, rows], q_rope_smem, q_bar)

        @pl.when(tail_steps > 0)
        def _():
            plgpu.copy_gmem_to_smem(bits_ref.at[c, :, rows], bits_smem, bits_bar)

        for i in range(STAGES):
            pl.when(i < total)(functools.partial(load_block, i, i))

        @pl.loop(0, total - STAGES)
        def _refill(i):
            slot = lax.rem(i, STAGES)
            plgpu.barrier_wait(consumed_bars.at[slot])
            load_block(i + STAGES, slot)

        @pl.loop(jnp.maximum(total - STAGES, 0), total)
        def _drain(i):  # observe every phase of the barriers this warpgroup waits on (the interpreter checks)
            plgpu.barrier_wait(consumed_bars.at[lax.rem(i, STAGES)])

    def compute_warpgroup(w):
        plgpu.set_max_registers(232, action="increase")
        other = 1 - w

        def exchange(x_row):  # -> (x of warpgroup 0, x of warpgroup 1), rows in WGMMA row layout
            row_smem[w] = x_row
            plgpu.barrier_arrive(row_bar)
            plgpu.barrier_wait(row_bar)
            theirs = plgpu.load(row_smem.at[other], layout=_ROW, optimized=False)
            return (x_row, theirs) if w == 0 else (theirs, x_row)

        def visible_keys(i, col, tail):
            """[64, 32] bool: which keys of this warpgroup's half of block i each row sees."""
            if not tail:
                return i * BLOCK_K + w * HALF_K + col < prefix_keys
            half_block = (i - steps) * 2 + w  # of the tail; the last one's word, if no key of it is a tail row
            word = plgpu.load(
                bits_smem.at[jnp.minimum(half_block, bits_smem.shape[0] - 1)], layout=_ROW, optimized=False
            )
            bits = lax.broadcast_in_dim(lax.bitcast_convert_type(word, jnp.int32), col.shape, [0])
            return (lax.shift_right_logical(bits, col) & 1 != 0) & (half_block * HALF_K + col < num_tail)

        def step(i, carry, tail):
            acc, m_prev, l_prev = carry
            slot = lax.rem(i, STAGES)
            plgpu.barrier_wait(kv_bars.at[slot * 2 + w])

            def scores(acc_ref):
                keys = kv_smem.at[slot, w]
                plgpu.wgmma(acc_ref, q_lat_smem, keys.at[:, pl.ds(0, LAT_DIM)].T)
                plgpu.wgmma(acc_ref, q_rope_smem, keys.at[:, pl.ds(LAT_DIM, ROPE_DIM)].T)
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((BLOCK_M, HALF_K), jnp.float32))
            col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_M, HALF_K), 1, layout=plgpu.Layout.WGMMA)
            s = jnp.where(visible_keys(i, col, tail), s * qk_scale, -jnp.inf)
            m0, m1 = exchange(s.max(axis=1))
            m_next = jnp.maximum(m_prev, jnp.maximum(m0, m1))  # finite in prefix blocks: each has a key for every row
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next) if tail else m_next  # a row that has seen no key yet
            alpha = jnp.exp2(m_prev - m_safe)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            l_next = l_prev * alpha + p.sum(axis=1)
            p_smem[w] = p.astype(p_smem.dtype)
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_bar)
            plgpu.barrier_wait(p_bar)
            plgpu.barrier_wait(kv_bars.at[slot * 2 + other])
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

            def values(acc_ref):
                for half in range(2):
                    plgpu.wgmma(acc_ref, p_smem.at[half], kv_smem.at[slot, half, :, pl.ds(w * HALF_R, HALF_R)])

            acc = _accumulate(acc, values, interpret)
            plgpu.barrier_arrive(consumed_bars.at[slot])
            return acc, m_next, l_next

        @pl.when(total > 0)
        def _():
            plgpu.barrier_wait(q_bar)

        @pl.when(tail_steps > 0)
        def _():
            plgpu.barrier_wait(bits_bar)

        carry = (
            plgpu.layout_cast(jnp.zeros((BLOCK_M, HALF_R), jnp.float32), plgpu.Layout.WGMMA),
            plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), _ROW),
            plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), _ROW),
        )
        carry = lax.fori_loop(0, steps, functools.partial(step, tail=False), carry)
        acc, m, l_own = lax.fori_loop(steps, total, functools.partial(step, tail=True), carry)
        l0, l1 = exchange(l_own)  # also orders every read of the queries before o_stage (their alias) is written
        l = l0 + l1
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
        partial_slot = group_ref[group, 6]  # read here, not live across the key loop
        for j in range(HALF_R // EPI_N):
            stage = j % 2
            if j >= 2:
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            o_stage[w, stage] = out[:, j * EPI_N : (j + 1) * EPI_N]
            plgpu.commit_smem()
            columns = pl.ds(w * HALF_R + j * EPI_N, EPI_N)
            plgpu.copy_smem_to_gmem(o_stage.at[w, stage], o_ref.at[partial_slot, rows, columns])
        if w == 0:
            lse_smem[...] = jnp.where(seen, m + jnp.log2(l_safe), -jnp.inf)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[partial_slot, rows])
        plgpu.wait_smem_to_gmem(0)

    for w in range(2):
        pl.when(wg == w)(functools.partial(compute_warpgroup, w))


@functools.partial(jax.jit, static_argnames=["plan", "qk_scale", "interpret"])
def mla_prefix_attention(
    q_lat_CMR,
    q_rope_CMP,
    cache,
    prefix_len,
    tail,
    tail_visible_CMT,
    *,
    plan: tuple[tuple[int, int, int], ...],
    qk_scale: float,
    cache_seq=None,
    interpret: bool = False,
):
    """Split partials on the GPU; arguments and results as in `mla_prefix_reference` (bf16 q, cache and tail,
    R = 512, P = 64). cache_seq [C] int32: the cache row holding sequence c (default c; `tree_mla_attention`
    passes layer * C + c into a layer stack viewed as [L*C, S_max, 576]). `interpret` runs Mosaic GPU's
    interpreter (CPU tests). The queries and the tail go to the kernel unpadded where their row counts are
    multiples of 8 (or at most 8; `pad_rows_for_tma`): its TMA boxes past their last row read zeros, so no XLA op
    concatenates or pads them in front of it."""
    C, M, R = q_lat_CMR.shape
    D = LAT_DIM + ROPE_DIM
    T = tail.shape[1]
    if tail.shape != (C, T, D) or tail.dtype != jnp.bfloat16:
        raise ValueError(f"tail must be bf16 [C, T, {D}] = [{C}, T, {D}], got {tail.dtype}{tail.shape}")
    if tail_visible_CMT.shape != (C, M, T) or tail_visible_CMT.dtype != jnp.bool_:
        raise ValueError(
            f"tail_visible must be bool [C, M, T] = [{C}, {M}, {T}], "
            f"got {tail_visible_CMT.dtype}{tail_visible_CMT.shape}"
        )
    if cache_seq is not None and cache_seq.shape != (C,):
        raise ValueError(f"cache_seq must be [C] = [{C}], got {cache_seq.shape}")
    if (
        R != LAT_DIM
        or q_rope_CMP.shape != (C, M, ROPE_DIM)
        or cache.shape[-1] != D
        or (cache_seq is None and cache.shape[0] != C)
    ):
        raise ValueError(
            f"q_lat [C, M, {LAT_DIM}], q_rope [C, M, {ROPE_DIM}] and cache [C, S_max, {D}] expected, "
            f"got {q_lat_CMR.shape}, {q_rope_CMP.shape} and {cache.shape}"
        )
    if {q_lat_CMR.dtype, q_rope_CMP.dtype, cache.dtype} != {jnp.dtype(jnp.bfloat16)}:
        raise ValueError(
            f"the Mosaic prefix kernel takes bf16, got q_lat {q_lat_CMR.dtype}, q_rope {q_rope_CMP.dtype} "
            f"and cache {cache.dtype}"
        )
    if cache.shape[1] % 8:
        raise ValueError(f"cache rows ({cache.shape[1]}) must be a multiple of 8 (TMA tiles)")
    num_key_blocks = pl.cdiv(cache.shape[1], BLOCK_K)
    if num_key_blocks**2 >= 2**31:  # group_table multiplies two block counts in int32
        raise ValueError(f"cache rows ({cache.shape[1]}) must be at most {BLOCK_K * 46340} (int32 group bounds)")
    plan = check_plan(plan, C, num_key_blocks)
    q_lat_CMR, q_rope_CMP, tail = (pad_rows_for_tma(x) for x in (q_lat_CMR, q_rope_CMP, tail))
    dtype = jnp.bfloat16
    num_rows = pl.cdiv(M, BLOCK_M) * BLOCK_M  # whole row tiles for the words and lse (TMA strides: 16 B multiples)
    bits = lax.bitcast_convert_type(tail_visibility_bits(tail_visible_CMT, num_rows), jnp.float32)  # TMA copies bytes
    scratch = [  # swizzled buffers first: a barrier placed between them costs a 1 KB alignment gap
        # the queries (swizzled as kv_smem: one wgmma wants one swizzle); dead after the key loop, then the output stage
        plgpu.RefUnion(
            (tiled_smem((BLOCK_M, LAT_DIM), dtype, 64), tiled_smem((BLOCK_M, ROPE_DIM), dtype, 64)),
            (tiled_smem((2, 2, BLOCK_M, EPI_N), jnp.float32, 128), plgpu.SMEM((BLOCK_M,), jnp.float32)),
        ),
        # kv_smem [slot, half block]; 32-key MMA operands need 64 B swizzle
        tiled_smem((STAGES, 2, HALF_K, D), dtype, 64),
        tiled_smem((2, BLOCK_M, HALF_K), dtype, HALF_K * 2),  # p_smem
        # row_smem: [2] the row exchange, [2 + half tail block] the visibility words (one buffer: each
        # allocation is 1 KB aligned, and two would not fit beside the rest for T = 129)
        plgpu.SMEM((2 + pl.cdiv(T, 32), BLOCK_M), jnp.float32),
        plgpu.Barrier(num_arrivals=2),  # q_bar: q_lat and q_rope
        plgpu.Barrier(),  # bits_bar
        plgpu.Barrier(num_barriers=STAGES * 2),  # kv_bars: [slot * 2 + half]
        plgpu.Barrier(num_arrivals=2, num_barriers=STAGES),  # consumed_bars
        plgpu.Barrier(num_arrivals=2),  # row_bar: the row exchange
        plgpu.Barrier(num_arrivals=2),  # p_bar
    ]
    kernel = plgpu.kernel(
        functools.partial(_kernel, num_tail=T, qk_scale=qk_scale, interpret=interpret),
        out_type=(
            jax.ShapeDtypeStruct((len(plan), q_lat_CMR.shape[1], LAT_DIM), jnp.float32),
            jax.ShapeDtypeStruct((len(plan), num_rows), jnp.float32),
        ),
        scratch_types=scratch,
        # the last grid axis is CUDA's x, launched fastest: a group's row tiles run side by side (its keys stay in
        # L2), then the groups in plan order (`mla_splits.plan_splits` models this order)
        grid=(len(plan), pl.cdiv(M, BLOCK_M)),
        grid_names=("group", "m"),
        num_threads=3,
        thread_name="wg",
        # the row reductions stay within a thread quad, so no cross-warp reduction scratch is reserved
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    if cache_seq is None:
        cache_seq = jnp.arange(C, dtype=jnp.int32)
    o, lse = kernel(
        group_table(plan, prefix_len, cache_seq, num_key_blocks, pl.cdiv(T, BLOCK_K)),
        q_lat_CMR,
        q_rope_CMP,
        cache,
        tail,
        bits,
    )
    return o[:, :M], lse[:, :M]
