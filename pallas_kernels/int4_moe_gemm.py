"""Fused MoE over INT4 (W4A16, group-32) experts: the jnp reference, the Pallas-Triton kernels, and `fused_moe`,
the public entry that picks the backend (these kernels, or int4_moe_mosaic's Mosaic GPU kernels where those fit).

The weight layout is int4_moe_common's. The dequantized weight is bf16(q * scale), rounded once as
compressed-tensors does, then cast to the activation dtype.
"""

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import arch, int4_moe_mosaic
from pallas_kernels.int4_moe_common import (
    GROUP,
    PACK,
    block_experts,
    check_args,
    expert_ranks,
    flatten_layers,
    group_starts,
    max_blocks,
    pair_rows,
)


def round_to_bf16(v):
    """Rounds float32 to the nearest bf16 value, kept in float32. Unlike a bf16 round trip through
    astype, XLA cannot drop it as excess precision under jit."""
    return jax.lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7)


def unpack_int4(packed, axis):
    """int32 words -> int8 values in [-8, 7]; `axis` grows 8x (row 8j+k = nibble k of word j)."""
    if packed.dtype != jnp.int32:
        raise ValueError(f"packed must be int32, got {packed.dtype}")
    axis = axis % packed.ndim
    shifts = jnp.arange(PACK, dtype=jnp.int32) * 4
    moved = jnp.moveaxis(packed, axis, -1)[..., None]  # [..., K/8, 1]
    nibbles = (moved >> shifts) & 0xF  # [..., K/8, 8]
    values = (nibbles - 8).astype(jnp.int8).reshape(*moved.shape[:-2], -1)
    return jnp.moveaxis(values, -1, axis)


def dequantize_int4(packed, scale, axis, dtype=jnp.bfloat16):
    """bf16(q * scale) cast to `dtype`; `scale` has K/32 entries along `axis` where `packed` has K/8."""
    q = unpack_int4(packed, axis)
    axis = axis % q.ndim
    if scale.shape[axis] * GROUP != q.shape[axis] or scale.ndim != q.ndim:
        raise ValueError(f"scale shape {scale.shape} does not match packed {packed.shape} on axis {axis}")
    scale_full = jnp.repeat(scale.astype(jnp.float32), GROUP, axis=axis)
    return round_to_bf16(q.astype(jnp.float32) * scale_full).astype(dtype)


def select_layer(weights, layer):
    """Weights stacked per layer ([n, E, ...] each) -> layer `layer`'s [E, ...] (layer None: unstacked input)."""
    if layer is None:
        return weights
    return tuple(jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False) for w in weights)


def fused_moe_reference(
    x,
    topk_ids,
    topk_weights,
    w13_packed,
    w13_scale,
    w2_packed,
    w2_scale,
    *,
    expert_offset=0,
    out_dtype=None,
    layer=None,
):
    """Plain-jnp fused MoE. x [M, D], topk_ids [M, k] int, topk_weights [M, k] -> y [M, D] (out_dtype or x.dtype).

    y[m] = sum_j topk_weights[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])), e = topk_ids[m, j] - expert_offset;
    ids outside [expert_offset, expert_offset + E) contribute nothing. Gate/up and down accumulate in fp32,
    h is cast to x.dtype, the top-k sum is fp32. Scans over the E local experts (one dequantized expert live
    at a time) and combines with a per-token coefficient, so memory stays O(M*D + D*I).
    layer: the weights are stacked per layer ([n, E, ...]) and this layer is used.
    """
    w13_packed, w13_scale, w2_packed, w2_scale = select_layer((w13_packed, w13_scale, w2_packed, w2_scale), layer)
    check_args(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale)
    local_ids = topk_ids.astype(jnp.int32) - expert_offset
    weights = topk_weights.astype(jnp.float32)

    def one_expert(y_acc, expert):
        e, w13_p, w13_s, w2_p, w2_s = expert
        w13 = dequantize_int4(w13_p, w13_s, axis=0, dtype=x.dtype)  # [D, 2, I]
        w2 = dequantize_int4(w2_p, w2_s, axis=0, dtype=x.dtype)  # [I, D]
        gate = jnp.dot(x, w13[:, 0], preferred_element_type=jnp.float32)
        up = jnp.dot(x, w13[:, 1], preferred_element_type=jnp.float32)
        h = (jax.nn.silu(gate) * up).astype(x.dtype)
        out = jnp.dot(h, w2, preferred_element_type=jnp.float32)  # [M, D]
        coef = jnp.sum(jnp.where(local_ids == e, weights, 0.0), axis=1)  # [M]
        return y_acc + coef[:, None] * out, None

    experts = (jnp.arange(w13_packed.shape[0]), w13_packed, w13_scale, w2_packed, w2_scale)
    y, _ = jax.lax.scan(one_expert, jnp.zeros(x.shape, jnp.float32), experts)
    return y.astype(out_dtype or x.dtype)


# ----------------------------------------------------------------------------- Pallas-Triton path

_WORDS_PER_GROUP = GROUP // PACK  # 4 packed rows share one scale row
_F32_TWO_POW_23 = 0x4B000000  # bits of float32 2**23; OR-ing a nibble u into the mantissa gives 2**23 + u


def _dequant_asm(k):
    """PTX for nibble k of two words ($1, $2) with their bf16 scales packed in $3 -> bf16x2 weights in $0.

    prmt gathers the 16-bit halves holding nibble k of both words, lop3 makes each half the bf16 128 + u
    (exponent 2**7, mantissa u), (128 + u) - 136 = q is exact, and the last fma rounds q * scale once.
    """
    halves = "0x5410" if k < 4 else "0x7632"
    shift = f"shr.u32 t, t, {4 * (k % 4)};" if k % 4 else ""
    return f"""{{
.reg .b32 t, lowbits, magic, one, neg136, negzero;
mov.b32 lowbits, 0x000F000F;
mov.b32 magic, 0x43004300;
mov.b32 one, 0x3F803F80;
mov.b32 neg136, 0xC308C308;
mov.b32 negzero, 0x80008000;
prmt.b32 t, $1, $2, {halves};
{shift}
lop3.b32 t, t, lowbits, magic, 0xEA;
fma.rn.bf16x2 t, t, one, neg136;
fma.rn.bf16x2 $0, t, $3, negzero;
}}"""


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static kernel configuration. Blocks are powers of two; `block_kw_*` count int32 words (8 K-rows each).

    per_pair: each row block holds a single (token, expert) pair and no sort runs (decode-sized M);
        otherwise pairs are sorted by expert and each expert's group is padded to `block_m` rows.
    split_k_down: the down GEMM's K (I) is split over this many programs, partials summed in the combine.
    dequant: "f32" (float32 bit tricks, any dtype, runs in interpret mode) or "asm" (PTX bf16x2, GPU + bf16).
    swap_ab: compute out^T = w^T x^T, so the dequantized weights are the MMA's first operand and stay in
        registers: Triton then emits wgmma (64 weight columns x block_m rows) instead of mma.sync.
    n_fastest: launch order puts the N tiles of one row block next to each other, so programs running
        together stream neighbouring columns of one expert; otherwise the row blocks vary fastest.
    """

    block_m: int = 16
    block_n_gate_up: int = 64
    block_n_down: int = 128
    block_kw_gate_up: int = 32
    block_kw_down: int = 32
    split_k_down: int = 1
    per_pair: bool = False
    num_warps: int = 4
    num_stages: int = 3
    dequant: str = "f32"
    n_fastest: bool = False
    swap_ab: bool = False


def choose_tiling(num_tokens, top_k, dtype=jnp.bfloat16, interpret=False):
    """The default Triton tiling for M = num_tokens, tuned on the H200 at K2.6 shapes (384 experts, top-8): one
    pair a block at decode, pairs sorted into 16- then 32-row blocks as the rows an expert grows, and 64-row blocks
    with swapped operands for prefill."""
    dequant = "asm" if (jnp.dtype(dtype) == jnp.bfloat16 and not interpret) else "f32"
    if num_tokens * top_k <= 32:  # decode (M <= 4): one pair per block, no sort
        return Tiling(per_pair=True, block_n_gate_up=64, block_n_down=128, dequant=dequant)
    if num_tokens <= 512:  # up to ~11 rows an expert: 16-row blocks
        return Tiling(block_m=16, block_n_gate_up=64, block_n_down=128, n_fastest=True, dequant=dequant)
    if num_tokens <= 2048:  # ~21 rows an expert at M = 1024
        return Tiling(block_m=32, block_n_gate_up=64, block_n_down=128, n_fastest=True, dequant=dequant)
    # prefill: 64-row blocks with the weights as wgmma's register operand
    return Tiling(block_m=64, block_kw_gate_up=16, block_kw_down=16, n_fastest=True, swap_ab=True, dequant=dequant)


def mosaic_block_m(num_tokens, dtype, d, i, interpret=False):
    """block_m of the Mosaic GPU kernels (int4_moe_mosaic) when `fused_moe`'s default should use them, else None:
    bf16 on a Hopper GPU (`arch.has_wgmma`), D and I that `int4_moe_mosaic.fits`, not interpreting. The block
    grows with the rows an expert gets (top-8 of 384 experts): 16 rows up to M = 512 (~11 rows an expert), 32 up
    to M = 1024 (~21), 64 beyond, where smaller blocks would split most experts."""
    if interpret or jnp.dtype(dtype) != jnp.bfloat16 or not int4_moe_mosaic.fits(d, i) or not arch.has_wgmma():
        return None
    return 16 if num_tokens <= 512 else 32 if num_tokens <= 1024 else 64


def _fit_block(block, dim, minimum, name):
    """Largest power of two <= block dividing dim, so every weight tile is in bounds without masks."""
    while block > minimum and dim % block:
        block //= 2
    if dim % block or block < minimum:
        raise ValueError(f"{name}={dim} needs a power-of-two block >= {minimum} that divides it")
    return block


def fit_tiling(tiling, d, i):
    """Shrinks N and K blocks to divisors of D and I (weights are never padded or copied)."""
    block_kw_down = _fit_block(tiling.block_kw_down, i // PACK, 16, "I/8 (packed intermediate rows)")
    return dataclasses.replace(
        tiling,
        block_n_gate_up=_fit_block(tiling.block_n_gate_up, i, 16, "I (intermediate size)"),
        block_n_down=_fit_block(tiling.block_n_down, d, 16, "D (hidden size)"),
        block_kw_gate_up=_fit_block(tiling.block_kw_gate_up, d // PACK, 16, "D/8 (packed hidden rows)"),
        block_kw_down=block_kw_down,
        split_k_down=math.gcd(tiling.split_k_down, i // PACK // block_kw_down),
    )


class Routing(NamedTuple):
    """Sorted routing: pairs grouped by expert, each group padded to block_m rows.

    block_expert [num_blocks] int32: local expert of each row block, -1 for unused trailing blocks.
    slot_pair [num_blocks * block_m] int32: flat pair index (token * k + j) of each row, -1 for padding.
    """

    block_expert: jax.Array
    slot_pair: jax.Array


def sort_routing(local_ids, num_experts, block_m):
    """local_ids [P] int32 (outside [0, E) = not on this shard) -> Routing padded to block_m multiples, pairs of
    an expert in pair order."""
    num_pairs = local_ids.shape[0]
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    counts, rank = expert_ranks(local_ids, num_experts)
    slot = pair_rows(local_ids, group_starts(counts, block_m), rank, num_blocks * block_m)
    slot_pair = (
        jnp.full((num_blocks * block_m,), -1, jnp.int32)
        .at[slot]
        .set(jnp.arange(num_pairs, dtype=jnp.int32), mode="drop")
    )
    return Routing(block_experts(counts, block_m, num_blocks), slot_pair)


def _block_pairs(block, route_refs, *, per_pair, block_m):
    """(local expert, pair ids [block_m] with -1 = padding) of one row block."""
    if per_pair:
        (local_ids_ref,) = route_refs  # [P]: expert of each pair minus expert_offset
        return local_ids_ref[block], jnp.where(jnp.arange(block_m) == 0, block, -1)
    block_expert_ref, slot_pair_ref = route_refs
    return block_expert_ref[block], slot_pair_ref[pl.ds(block * block_m, block_m)]


def _group_rows(step, block_kw):
    """Scale rows of K step `step`: one per 4 packed rows, loaded once and repeated in registers."""
    return pl.ds(step * (block_kw // _WORDS_PER_GROUP), block_kw // _WORDS_PER_GROUP)


def _repeat_rows(scale):
    """[kw/4, n] -> [kw, n], each scale row repeated for its 4 packed rows."""
    groups, n = scale.shape
    return jnp.broadcast_to(scale[:, None, :], (groups, _WORDS_PER_GROUP, n)).reshape(groups * _WORDS_PER_GROUP, n)


def _scale_for(scale, dequant):
    """Scale tile in the form _dequantize_nibble takes: bf16 for the PTX path, f32 for the f32 path."""
    return scale if dequant == "asm" else scale.astype(jnp.float32)


def _dequantize_nibble(packed, scale, k, dtype, dequant):
    """packed [kw, n] int32, scale [kw, n] (bf16 for "asm", f32 for "f32"; one row per word) -> [kw, n]
    bf16(q * scale) of nibble k in `dtype`, i.e. the weights of input rows 8 * word + k."""
    if dequant == "asm":  # one asm instance handles two words (pack=2)
        [w] = plgpu.elementwise_inline_asm(
            _dequant_asm(k),
            args=[packed, scale],
            constraints="=r,r,r,r",
            pack=2,
            result_shape_dtypes=[jax.ShapeDtypeStruct(packed.shape, jnp.bfloat16)],
        )
        return w.astype(dtype)
    nibble_bits = ((packed >> (4 * k)) & 0xF) | _F32_TWO_POW_23
    w = (jax.lax.bitcast_convert_type(nibble_bits, jnp.float32) - float(2**23 + 8)) * scale  # exact product
    if dtype == jnp.bfloat16:
        return w.astype(jnp.bfloat16)
    # Round to bf16 on the bits: interpret mode's XLA may drop an f32 -> bf16 -> f32 round trip.
    bits = jax.lax.bitcast_convert_type(w, jnp.int32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(dtype)


def to_nibble_major(a):
    """[..., K] -> [..., K] with column k * K/8 + j holding a[..., 8j + k]: the input rows of nibble k of
    word j become contiguous, matching the packed weights."""
    return a.reshape(*a.shape[:-1], a.shape[-1] // PACK, PACK).swapaxes(-1, -2).reshape(a.shape)


def _dot(a, b):
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


def _weight_dot(x, w, swap_ab):
    """x [m, kw] @ w [kw, n] -> [m, n], or its transpose w^T @ x^T -> [n, m] when swap_ab."""
    return _dot(w.T, x.T) if swap_ab else _dot(x, w)


def _accumulator(block_m, block_n, swap_ab):
    """Zero fp32 accumulator in the orientation `_weight_dot` produces."""
    return jnp.zeros((block_n, block_m) if swap_ab else (block_m, block_n), jnp.float32)


def _rows_first(acc, swap_ab):
    """Accumulator -> [block_m rows, block_n columns]."""
    return acc.T if swap_ab else acc


_MAX_GRID_YZ = 65535  # CUDA's limit on the 2nd and 3rd grid dimensions


def _grid(num_blocks, num_n_tiles, n_fastest, *rest):
    """Grid and the (row block, N tile) ids of the running program for the launch order `n_fastest` picks.
    Row blocks stay on the first grid axis when there are more than CUDA allows on the second (prefill)."""
    if n_fastest and num_blocks <= _MAX_GRID_YZ:
        return (num_n_tiles, num_blocks, *rest), lambda: (pl.program_id(1), pl.program_id(0))
    return (num_blocks, num_n_tiles, *rest), lambda: (pl.program_id(0), pl.program_id(1))


def _gate_up_kernel(*refs, per_pair, num_experts, top_k, block_m, block_n, block_kw, dequant, program_ids, swap_ab):
    """Program (row block b, I tile n): h[rows of b, cols of n] = silu(x @ gate) * up, fp32 accumulation.

    refs: route refs, x [M, D] nibble-major, w13_packed [E, D/8, 2, I], w13_scale [E, D/32, 2, I]
    -> h [rows, I] nibble-major (see `to_nibble_major`), so each nibble's weight tile meets contiguous inputs.
    """
    *route_refs, x_ref, w_ref, s_ref, h_ref = refs
    b, n = program_ids()
    expert, pair = _block_pairs(b, route_refs, per_pair=per_pair, block_m=block_m)

    @pl.when((expert >= 0) & (expert < num_experts))
    def _():
        row_ok = pair >= 0
        token = jnp.where(row_ok, pair // top_k, 0)
        cols = pl.ds(n * block_n, block_n)

        def k_step(step, accs):
            acc_gate, acc_up = accs
            words = step * block_kw + jnp.arange(block_kw)
            rows = pl.ds(step * block_kw, block_kw)
            groups = _group_rows(step, block_kw)
            gate_packed, up_packed = w_ref[expert, rows, 0, cols], w_ref[expert, rows, 1, cols]
            gate_scale = _scale_for(_repeat_rows(s_ref[expert, groups, 0, cols]), dequant)
            up_scale = _scale_for(_repeat_rows(s_ref[expert, groups, 1, cols]), dequant)
            for k in range(PACK):  # one nibble's tiles live at a time
                x_k = plgpu.load(
                    x_ref.at[token[:, None], (k * x_ref.shape[1] // PACK + words)[None, :]],
                    mask=row_ok[:, None],
                    other=0,
                )
                acc_gate += _weight_dot(
                    x_k, _dequantize_nibble(gate_packed, gate_scale, k, x_ref.dtype, dequant), swap_ab
                )
                acc_up += _weight_dot(x_k, _dequantize_nibble(up_packed, up_scale, k, x_ref.dtype, dequant), swap_ab)
            return acc_gate, acc_up

        zeros = _accumulator(block_m, block_n, swap_ab)
        acc_gate, acc_up = jax.lax.fori_loop(0, w_ref.shape[1] // block_kw, k_step, (zeros, zeros))
        h = _rows_first(acc_gate / (1.0 + jnp.exp(-acc_gate)) * acc_up, swap_ab)
        h_cols = n * block_n + jnp.arange(block_n)  # column 8j + k goes to k * I/8 + j
        h_cols = h_cols % PACK * (h_ref.shape[1] // PACK) + h_cols // PACK
        slots = b * block_m + jnp.arange(block_m)
        plgpu.store(h_ref.at[slots[:, None], h_cols[None, :]], h.astype(h_ref.dtype), mask=row_ok[:, None])


def _down_kernel(
    *refs, per_pair, num_experts, block_m, block_n, block_kw, steps_per_split, dequant, program_ids, swap_ab
):
    """Program (row block b, D tile n, K split s): y[s, pairs of b, cols of n] = weight * (h @ down), fp32.

    refs: route refs, topk_weights [P] f32, h [rows, I] nibble-major, w2_packed [E, I/8, D], w2_scale [E, I/32, D]
    -> y_pairs [S, P + block_m, D] f32 (rows of pairs off this shard and the spare rows stay unwritten).
    """
    *route_refs, weight_ref, h_ref, w_ref, s_ref, y_ref = refs
    (b, n), split = program_ids(), pl.program_id(2)
    expert, pair = _block_pairs(b, route_refs, per_pair=per_pair, block_m=block_m)

    @pl.when((expert >= 0) & (expert < num_experts))
    def _():
        row_ok = pair >= 0
        slots = b * block_m + jnp.arange(block_m)
        cols = pl.ds(n * block_n, block_n)

        def k_step(step, acc):
            words = step * block_kw + jnp.arange(block_kw)
            packed = w_ref[expert, pl.ds(step * block_kw, block_kw), cols]
            scale = _scale_for(_repeat_rows(s_ref[expert, _group_rows(step, block_kw), cols]), dequant)
            for k in range(PACK):
                h_k = plgpu.load(
                    h_ref.at[slots[:, None], (k * h_ref.shape[1] // PACK + words)[None, :]],
                    mask=row_ok[:, None],
                    other=0,
                )
                acc += _weight_dot(h_k, _dequantize_nibble(packed, scale, k, h_ref.dtype, dequant), swap_ab)
            return acc

        first = split * steps_per_split
        acc = jax.lax.fori_loop(first, first + steps_per_split, k_step, _accumulator(block_m, block_n, swap_ab))
        acc = _rows_first(acc, swap_ab)
        weight = plgpu.load(weight_ref.at[jnp.where(row_ok, pair, 0)], mask=row_ok, other=0.0)
        # Padding rows aim at distinct spare rows past the pairs: masked, so never written on the GPU, and
        # interpret mode's read-modify-write of a masked scatter cannot clobber a real row.
        out_rows = jnp.where(row_ok, pair, y_ref.shape[1] - block_m + jnp.arange(block_m))
        col_ids = n * block_n + jnp.arange(block_n)
        plgpu.store(y_ref.at[split, out_rows[:, None], col_ids[None, :]], acc * weight[:, None], mask=row_ok[:, None])


def fused_moe(
    x,
    topk_ids,
    topk_weights,
    w13_packed,
    w13_scale,
    w2_packed,
    w2_scale,
    *,
    expert_offset=0,
    tiling=None,
    out_dtype=None,
    pair_rows_fp32=False,
    interpret=False,
    layer=None,
):
    """Fused MoE on the GPU with the contract of `fused_moe_reference`: the Mosaic GPU kernels of int4_moe_mosaic
    where `mosaic_block_m` says so and no `tiling` is given, else the Triton kernels (`fused_moe_triton`).

    expert_offset (may be traced): ids minus it index the E local experts (expert parallelism).
    layer (may be traced): the weights are stacked per layer ([n, E, ...]); the kernels index layer `layer`
    inside the whole stack (viewed as [n*E, ...], a free reshape), so no per-layer copy of the experts is
    made, as slicing the stack in front of the custom call would.
    pair_rows_fp32: the Mosaic kernels round each (token, expert) pair's down output to bf16 before the
    weighted top-k sum (as transformers does) unless this is set (partial sums over a split I); the Triton
    kernels keep fp32 rows either way.
    """
    args = (x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale)
    if tiling is None and (
        block_m := mosaic_block_m(topk_ids.shape[0], x.dtype, x.shape[-1], w13_packed.shape[-1], interpret)
    ):
        return int4_moe_mosaic.fused_moe_mosaic(
            *args,
            expert_offset=expert_offset,
            block_m=block_m,
            out_dtype=out_dtype,
            pair_rows_fp32=pair_rows_fp32,
            layer=layer,
        )
    return fused_moe_triton(
        *args, expert_offset=expert_offset, tiling=tiling, out_dtype=out_dtype, interpret=interpret, layer=layer
    )


def fused_moe_triton(
    x,
    topk_ids,
    topk_weights,
    w13_packed,
    w13_scale,
    w2_packed,
    w2_scale,
    *,
    expert_offset=0,
    tiling=None,
    out_dtype=None,
    interpret=False,
    layer=None,
):
    """The Pallas-Triton kernels; arguments as `fused_moe`'s.

    Routing metadata in XLA (pairs sorted by expert and padded to block_m rows, or one pair per block when
    `tiling.per_pair`), then two grouped W4A16 kernels (gate_up with the SiLU*up epilogue; down with the
    routing weight and optional split-K), then the fp32 top-k (and split) combine in XLA.
    tiling: None = `choose_tiling(M)`; N/K blocks are shrunk to divide D and I.
    """
    weights, num_experts, stack_offset = flatten_layers((w13_packed, w13_scale, w2_packed, w2_scale), layer)
    w13_packed, w13_scale, w2_packed, w2_scale = weights
    check_args(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale)
    d, i = x.shape[1], w13_packed.shape[-1]
    if x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    tiling = fit_tiling(tiling or choose_tiling(num_tokens, top_k, x.dtype, interpret), d, i)
    if tiling.dequant == "asm" and (interpret or x.dtype != jnp.bfloat16):
        raise ValueError("tiling.dequant='asm' needs bf16 x and interpret=False")
    bm = tiling.block_m
    local_ids = topk_ids.reshape(-1).astype(jnp.int32)
    if not (isinstance(expert_offset, int) and expert_offset == 0):  # may be traced (EP)
        local_ids = local_ids - expert_offset
    if tiling.per_pair:
        route, num_blocks = (local_ids,), num_pairs
    else:
        route = sort_routing(local_ids, num_experts, bm)
        num_blocks = route.block_expert.shape[0]
    if layer is not None:  # rows of this layer in the flattened stack; off-shard/padding stays -1
        route = tuple(jnp.where((r >= 0) & (r < num_experts), r + stack_offset, -1) for r in route[:1]) + route[1:]
    common = dict(
        per_pair=tiling.per_pair,
        num_experts=w13_packed.shape[0],
        block_m=bm,
        dequant=tiling.dequant,
        swap_ab=tiling.swap_ab,
    )
    params = plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages)

    grid, program_ids = _grid(num_blocks, i // tiling.block_n_gate_up, tiling.n_fastest)
    h = pl.pallas_call(
        functools.partial(
            _gate_up_kernel,
            top_k=top_k,
            block_n=tiling.block_n_gate_up,
            block_kw=tiling.block_kw_gate_up,
            program_ids=program_ids,
            **common,
        ),
        out_shape=jax.ShapeDtypeStruct((num_blocks * bm, i), x.dtype),
        grid=grid,
        compiler_params=params,
        interpret=interpret,
        name="moe_gate_up",
    )(*route, to_nibble_major(x), w13_packed, w13_scale)

    steps = i // PACK // tiling.block_kw_down
    grid, program_ids = _grid(num_blocks, d // tiling.block_n_down, tiling.n_fastest, tiling.split_k_down)
    y_pairs = pl.pallas_call(
        functools.partial(
            _down_kernel,
            block_n=tiling.block_n_down,
            block_kw=tiling.block_kw_down,
            steps_per_split=steps // tiling.split_k_down,
            program_ids=program_ids,
            **common,
        ),
        out_shape=jax.ShapeDtypeStruct((tiling.split_k_down, num_pairs + bm, d), jnp.float32),
        grid=grid,
        compiler_params=params,
        interpret=interpret,
        name="moe_down",
    )(*route, topk_weights.reshape(-1).astype(jnp.float32), h, w2_packed, w2_scale)

    on_shard = ((local_ids >= 0) & (local_ids < num_experts))[None, :, None]
    y = jnp.where(on_shard, y_pairs[:, :num_pairs], 0.0).sum(axis=0)
    return y.reshape(num_tokens, top_k, d).sum(axis=1).astype(out_dtype or x.dtype)
