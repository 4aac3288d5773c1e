"""INT4 MoE GEMMs as warp-specialised Mosaic GPU kernels (Hopper, bf16; `int4_moe_gemm.fused_moe` takes them
there): the weights dequantized in registers feed wgmma as its A operand, so every weight tile is dequantized once
for up to 64 rows.

Why a second backend: the Triton kernels dequantize a weight tile once per 16- or 32-row block and keep it in
registers next to a [rows, 64] accumulator; with more rows an expert they either dequantize a tile twice or run
two CTAs an SM. Here each CTA owns its pipeline:

  persistent CTAs walk the tiles (row block b, N tile n) of the routing (`routed_operands`);
  warpgroup 4 streams, per K stage of 256 inputs: two [32 words, 128 cols] int32 weight tiles, their
    [8 groups, 128] bf16 scales and the block's 4 x [block_m, 64] activations, through an S-stage TMA ring
    that runs on across tiles;
  warpgroups 0-3 each take 64 columns of one of the two tiles: load the words transposed ([64 cols, 32
    words], each thread holding rows r, r+8 and words 2q, 2q+1 of every 8), dequantize a 64-input chunk into
    the bf16 wgmma A fragment [64 cols, 64 inputs] with PTX (lop3 / sub / mul, bf16(q * scale) rounded
    once), and issue wgmma against the activations. The dequant arithmetic, not memory, bounds the loop.

A row block multiplies only its valid rows rounded up to a multiple of 8, the least wgmma N (`wgmma_widths`):
the compute warpgroups branch on the block's row count to one of block_m / 8 instances of the main loop and
epilogue, so a partly filled block costs what its rows need.

The A fragment of thread (row r, quad lane q) covers inputs k = 16i + 8e + 2q + h of a chunk (k16 step i,
half e, pair h). The nibbles a thread holds are inputs 8 * (2q + e) + j of its two words, so wgmma column k
is fed physical input P1[k] = 16q + 8e + 4h + i: (nibble i, nibble i + 4) of word 2q + e is one bf16x2
register. The activations are permuted the same way (`to_p1_order`), so the product is unchanged.

The two weight tiles are (gate, up) of one 128-column slice for gate_up (epilogue: each up warpgroup hands its
accumulator to the gate warpgroup of its columns through shared memory, which writes silu(gate) * up -> h,
bf16) and two adjacent 128-column slices for down (epilogue: rows in slot order; the caller gathers each
(token, expert) pair's row, applies the routing weight and sums the top k in fp32). Down's rows are bf16, each
pair's expert output rounded once, as transformers' DeepseekV3MoE rounds `expert(x)`; fp32 rows
(`pair_rows_fp32`) are for partial sums over a split intermediate dim, at twice the bytes.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.int4_moe_common import (
    PACK,
    block_experts,
    check_args,
    expert_ranks,
    flatten_layers,
    group_starts,
    max_blocks,
    pair_rows,
)
from pallas_kernels.mosaic_common import tiled_smem

CHUNK = 64  # inputs a wgmma call (one 128-byte swizzle row of bf16)
STAGE_WORDS = 32  # packed int32 rows a pipeline stage: 256 inputs, 4 chunks
STAGE_CHUNKS = STAGE_WORDS * PACK // CHUNK
TILE_N = 128  # columns a TMA weight tile; each compute warpgroup takes 64
WG_N = 64
NUM_COPIES = 2 + 2 + STAGE_CHUNKS  # TMA copies arriving on a stage's barrier: weights, scales, activations
NUM_COMPUTE = 4  # compute warpgroups (0-3); warpgroup 4 streams
# Registers a thread: ptxas gives every thread of the CTA LAUNCH_REGISTERS, and setmaxnreg only moves them
# between warpgroups (an increase that the decreases do not cover waits forever).
LAUNCH_REGISTERS = 65536 // (128 * (NUM_COMPUTE + 1)) // 8 * 8
COMPUTE_REGISTERS, MEMORY_REGISTERS = 112, 24
SMEM_BYTES = 227 * 1024
WIDTH_STEP = 8  # a block multiplies its valid rows rounded up to a multiple of this (the least wgmma N)


def _input_permutation():
    """P1 [64]: wgmma column k of a chunk reads physical input P1[k] (see the module docstring)."""
    k = np.arange(CHUNK)
    i, e, q, h = k // 16, (k // 8) % 2, (k // 2) % 4, k % 2
    return 16 * q + 8 * e + 4 * h + i


P1 = _input_permutation()


def to_p1_order(a):
    """[..., K] -> [..., K] with column 64t + k holding a[..., 64t + P1[k]] (K a multiple of 64). A reshape and
    transpose (physical p = 16q + 8e + 4h + i -> k = 16i + 8e + 2q + h), so kernels may use it too."""
    lead = a.shape[:-1]
    split = a.reshape(*lead, a.shape[-1] // CHUNK, 4, 2, 2, 4)  # [..., t, q, e, h, i]
    n = split.ndim
    return split.transpose(*range(n - 4), n - 1, n - 3, n - 4, n - 2).reshape(a.shape)


_DEQUANT_ASM = """{
.reg .b32 t;
lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA;
sub.bf16x2 t, t, $3;
mul.rn.bf16x2 $0, t, $2;
}"""  # (128 + u) - 136 = q exactly; one rounding of q * scale


def _thread_coords():
    """(row r, quad lane q) of this thread in its warpgroup's WGMMA fragments, as i32 values: it holds rows r and
    r + 8, and columns 2q, 2q + 1 of every 8."""
    i32 = ir.IntegerType.get_signless(32)
    c = lambda v: arith.constant(i32, v)
    tid = arith.remui(mgpu_utils.thread_idx(), c(128))
    lane = arith.andi(tid, c(31))
    return arith.addi(arith.muli(arith.shrui(tid, c(5)), c(16)), arith.shrui(lane, c(2))), arith.andi(lane, c(3))


def _dequant_chunk(words, scales_ref, chunk, first_col):
    """words int32 [64, 8] (WGMMA layout: thread holds words 2q, 2q+1 of rows r, r+8), scales_ref bf16
    [8 groups, n] (plain shared memory) of the stage, columns first_col + [0, 64) this warpgroup's
    -> bf16 [64, 64] WGMMA A fragment in P1 order. Both words of a thread lie in group 2 chunk + q // 2."""

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((64, CHUNK), jnp.bfloat16, plgpu.Layout.WGMMA),
    )
    def dequant(_, words, scales):
        i32, i16, index = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(16), ir.IndexType.get()
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        c = lambda v: arith.constant(i32, v)
        row, q = _thread_coords()
        group = arith.index_cast(index, arith.addi(c(2 * chunk), arith.shrui(q, c(1))))
        neg136 = c(0x43084308)
        out = np.empty((8, 2), dtype=object)  # [k8 block 2i + e, row half]
        for half in range(2):
            col = arith.index_cast(index, arith.addi(row, c(first_col + 8 * half)))
            scale = arith.extui(i32, mgpu_utils.bitcast(memref.load(scales, [group, col]), i16))
            scale2 = arith.muli(scale, c(0x10001))  # {s, s}
            pair = words.registers.flat[half]  # vector<2xi32>: words 2q, 2q+1 of this row
            for e in range(2):
                word = llvm.extractelement(pair, c(e))
                for i in range(4):
                    shifted = arith.shrui(word, c(4 * i)) if i else word
                    reg = llvm.inline_asm(i32, [shifted, scale2, neg136], _DEQUANT_ASM, "=r,r,r,r")
                    out[2 * i + e, half] = mgpu_utils.bitcast(reg, bf16x2)
        return mgpu_fa.FragmentedArray(
            _registers=out.reshape(1, 8, 1, 1, 2, 1, 1, 1, 1), _layout=mgpu_fa.WGMMA_LAYOUT, _is_signed=None
        )

    return dequant(words, scales_ref)


def _dequant_chunk_jnp(words, scales, chunk):
    """Interpret-mode twin of `_dequant_chunk`: words int32 [64, 32], scales bf16 [8, 64] of the stage ->
    bf16 [64, 64] in P1 order. (No array constants: the kernel may not capture any.)"""
    chunk_words = words[:, chunk * 8 : (chunk + 1) * 8]
    shifts = lax.broadcasted_iota(jnp.int32, (64, 8, PACK), 2) * 4
    q = (lax.shift_right_logical(chunk_words[:, :, None], shifts) & 0xF) - 8  # [col, word, nibble]
    scale = scales[2 * chunk : 2 * chunk + 2].T.astype(jnp.float32)  # [col, group]: words 0-3, 4-7
    w = q.reshape(64, 2, 4 * PACK).astype(jnp.float32) * scale[:, :, None]
    return to_p1_order(w.astype(jnp.bfloat16).reshape(64, CHUNK))


def _store_transposed(acc, out_ref, p1_order):
    """acc [64 cols, bm] (WGMMA layout) -> out_ref [bm, 64] (plain shared memory): out_ref[s, n] = acc[n, s],
    or out_ref[s, k] = acc[P1[k], s] when p1_order (h, in the input order the down kernel reads). Each thread
    stores its own elements, so the transposition costs no shuffles."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(_, acc, ref):
        i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
        c = lambda v: arith.constant(i32, v)
        row, q = _thread_coords()
        bits = lambda v, shift, mask: arith.andi(arith.shrui(v, c(shift)), c(mask))
        for half in range(2):
            n = arith.addi(row, c(8 * half))
            if p1_order:  # n = 16q' + 8e + 4h + i sits at column 16i + 8e + 2q' + h
                n = arith.addi(
                    arith.addi(arith.muli(bits(n, 0, 3), c(16)), arith.muli(bits(n, 3, 1), c(8))),
                    arith.addi(arith.muli(bits(n, 4, 3), c(2)), bits(n, 2, 1)),
                )
            col = arith.index_cast(index, n)
            for j in range(acc.shape[1] // 8):
                reg = acc.registers[0, j, 0, 0, half, 0, 0, 0, 0]
                for pair in range(2):
                    s = arith.index_cast(index, arith.addi(arith.muli(q, c(2)), c(8 * j + pair)))
                    memref.store(llvm.extractelement(reg, c(pair)), ref, [s, col])

    store(acc, out_ref)


def _stash_column():
    """2t as an index, for thread t of its warpgroup: where its registers sit in a `_stash` row."""
    i32 = ir.IntegerType.get_signless(32)
    tid = arith.remui(mgpu_utils.thread_idx(), arith.constant(i32, 128))
    return arith.index_cast(ir.IndexType.get(), arith.muli(tid, arith.constant(i32, 2)))


def _stash(acc, ref):
    """acc f32 [64, bm] (WGMMA layout) -> ref f32 [bm / 4, 256]: register i of thread t at [i, 2t : 2t + 2], read
    back by `_unstash` in any warpgroup (conflict-free, no layout change)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(_, acc, ref):
        col = _stash_column()
        for i, reg in enumerate(acc.registers.flat):
            vector.store(reg, ref, [arith.constant(ir.IndexType.get(), i), col])

    store(acc, ref)


def _unstash(ref, block_m):
    """The inverse of `_stash`: ref f32 [bm / 4, 256] -> f32 [64, bm] in WGMMA layout."""
    shape = (64, block_m)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),), return_type=plgpu.ShapeDtypeStruct(shape, jnp.float32, plgpu.Layout.WGMMA)
    )
    def load(_, ref):
        index, f32x2 = ir.IndexType.get(), ir.VectorType.get((2,), ir.F32Type.get())
        col = _stash_column()
        regs = np.empty(mgpu_fa.WGMMA_LAYOUT.registers_shape(shape), dtype=object)
        for i in range(regs.size):
            regs.flat[i] = vector.load(f32x2, ref, [arith.constant(index, i), col])
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=mgpu_fa.WGMMA_LAYOUT, _is_signed=None)

    return load(ref)


def _kernel(
    num_blocks_ref,
    block_expert_ref,
    block_row_ref,
    block_rows_ref,
    x_ref,
    w_ref,
    s_ref,
    out_ref,
    w_smem,
    s_smem,
    x_smem,
    a_smem,
    out_smem,
    up_smem,
    full_bars,
    empty_bars,
    up_full_bars,
    up_empty_bars,
    *,
    gate_up,
    block_m,
    widths,
    num_stages,
    interpret,
):
    """Both GEMMs. x [rows, K] bf16 (P1-permuted); row block b reads x rows block_row[b] .. + block_m and
    multiplies the first of them: the smallest of `widths` (ascending, the last block_m) that covers its
    block_rows[b] valid rows, and writes those rows of its output slots only (the others are padding, never
    read).
    gate_up: w [E, K/8, 2, N] int32, s [E, K/32, 2, N] bf16, out h [rows, N] bf16 (rows in slot order);
    down: w [E, K/8, N], s [E, K/32, N], out y [rows, N] (rows in slot order). Output rows are slots:
    b * block_m + [0, block_m). Compute warpgroup w multiplies weight tile w // 2 (gate / up, or the first /
    second 128 columns), columns (w % 2) * 64 + [0, 64); gate_up's up warpgroups hand their accumulator to the
    gate warpgroup of the same columns through up_smem."""
    sm, wg, num_sms = lax.axis_index("sm"), lax.axis_index("wg"), lax.axis_size("sm")
    cols_per_tile = 2 * TILE_N if not gate_up else TILE_N
    num_n_tiles = out_ref.shape[1] // cols_per_tile
    steps = x_ref.shape[1] // (STAGE_WORDS * PACK)
    num_tiles = num_blocks_ref[0] * num_n_tiles
    my_tiles = jnp.maximum(lax.div(num_tiles - sm + num_sms - 1, num_sms), 0)
    total_steps = my_tiles * steps

    def tile_coords(j):
        t = sm + j * num_sms
        return lax.div(t, num_n_tiles), lax.rem(t, num_n_tiles)

    @pl.when(wg == NUM_COMPUTE)
    def _memory_warpgroup():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        @pl.loop(0, my_tiles)
        def _tile(j):
            b, n = tile_coords(j)
            expert, x_row = block_expert_ref[b], block_row_ref[b]

            @pl.loop(0, steps)
            def _step(k):
                g = j * steps + k
                slot = lax.rem(g, num_stages)

                @pl.when(g >= num_stages)
                def _():
                    with jax.named_scope("wait_empty"):  # named scopes are the ranges of Mosaic's profiler
                        plgpu.barrier_wait(empty_bars.at[slot])

                bar = full_bars.at[slot]
                words = pl.ds(pl.multiple_of(k * STAGE_WORDS, STAGE_WORDS), STAGE_WORDS)
                groups = pl.ds(pl.multiple_of(k * STAGE_WORDS // 4, 8), STAGE_WORDS // 4)
                for o in range(2):
                    if gate_up:
                        cols = pl.ds(pl.multiple_of(n * TILE_N, TILE_N), TILE_N)
                        w_src, s_src = w_ref.at[expert, words, o, cols], s_ref.at[expert, groups, o, cols]
                    else:
                        cols = pl.ds(pl.multiple_of(n * 2 * TILE_N + o * TILE_N, TILE_N), TILE_N)
                        w_src, s_src = w_ref.at[expert, words, cols], s_ref.at[expert, groups, cols]
                    plgpu.copy_gmem_to_smem(w_src, w_smem.at[slot, o], bar)
                    plgpu.copy_gmem_to_smem(s_src, s_smem.at[slot, o], bar)
                rows = pl.ds(x_row, block_m)
                for c in range(STAGE_CHUNKS):
                    inputs = pl.ds(pl.multiple_of(k * STAGE_WORDS * PACK + c * CHUNK, CHUNK), CHUNK)
                    plgpu.copy_gmem_to_smem(x_ref.at[rows, inputs], x_smem.at[slot, c], bar)

        @pl.loop(jnp.maximum(total_steps - num_stages, 0), total_steps)
        def _drain(g):  # observe every phase of the barriers this warpgroup waits on (the interpreter checks)
            plgpu.barrier_wait(empty_bars.at[lax.rem(g, num_stages)])

    def compute_warpgroup(w):
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        o, half = divmod(w, 2)
        my_cols = pl.ds(half * WG_N, WG_N)

        def mainloop(j, width, acc_ref):
            @pl.loop(0, steps)
            def _step(k):
                slot = lax.rem(j * steps + k, num_stages)
                with jax.named_scope("wait_full"):
                    plgpu.barrier_wait(full_bars.at[slot])
                tile = w_smem.at[slot, o, :, my_cols].T  # [64 cols, 32 words]
                if interpret:
                    words, scales = tile[...], s_smem[slot, o, :, my_cols]
                else:
                    words = plgpu.layout_cast(
                        plgpu.load(tile, layout=plgpu.Layout._WGMMA_ACC_32BIT), plgpu.Layout.WGMMA
                    )
                for c in range(STAGE_CHUNKS):
                    x_t = x_smem.at[slot, c, pl.ds(0, width)].T
                    if interpret:
                        a_smem[w] = _dequant_chunk_jnp(words, scales, c)
                        plgpu.commit_smem()
                        plgpu.wgmma(acc_ref, a_smem.at[w], x_t)
                        plgpu.wgmma_wait(0)
                    else:  # dequantize the next chunk while this one multiplies
                        a = _dequant_chunk(words[:, c * 8 : (c + 1) * 8], s_smem.at[slot, o], c, half * WG_N)
                        plgpu.wgmma(acc_ref, a, x_t)
                        plgpu.wgmma_wait(1)
                plgpu.wgmma_wait(0)  # in the step: the slot is freed here, not in the next step's body
                plgpu.barrier_arrive(empty_bars.at[slot])

            return acc_ref[...]

        def store_rows(tile, ref, rows, cols, p1_order):
            """tile [64 cols, width] -> out_ref[rows, cols] (width rows), through ref [bm, 64]."""
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read ref
            staged = ref.at[pl.ds(0, tile.shape[1])]
            if interpret:
                staged[...] = to_p1_order(tile.T) if p1_order else tile.T
            else:
                _store_transposed(tile, ref, p1_order=p1_order)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(staged, out_ref.at[rows, cols])

        def tile(j, b, n, width):
            acc = pl.run_scoped(functools.partial(mainloop, j, width), plgpu.ACC((WG_N, width), jnp.float32))
            rows = pl.ds(pl.multiple_of(b * block_m, block_m), width)  # the slots past width stay unwritten
            stash_rows = pl.ds(0, width // 4)
            with jax.named_scope("epilogue"):
                if not gate_up:
                    cols = pl.ds(pl.multiple_of(n * 2 * TILE_N + o * TILE_N + half * WG_N, WG_N), WG_N)
                    store_rows(acc.astype(out_smem.dtype), out_smem.at[w], rows, cols, p1_order=False)
                elif o == 1:  # up: hand it to the gate warpgroup of these columns
                    if interpret:
                        up_smem[half, stash_rows] = acc.reshape(width // 4, up_smem.shape[2])
                    else:
                        _stash(acc, up_smem.at[half])
                    plgpu.barrier_arrive(up_full_bars.at[half])
                    plgpu.barrier_wait(up_empty_bars.at[half])
                else:
                    plgpu.barrier_wait(up_full_bars.at[half])
                    up = (
                        up_smem[half, stash_rows].reshape(acc.shape) if interpret else _unstash(up_smem.at[half], width)
                    )
                    plgpu.barrier_arrive(up_empty_bars.at[half])
                    h = (acc / (1.0 + jnp.exp(-acc)) * up).astype(out_smem.dtype)
                    cols = pl.ds(pl.multiple_of(n * TILE_N + half * WG_N, WG_N), WG_N)
                    store_rows(h, out_smem.at[half], rows, cols, p1_order=True)

        @pl.loop(0, my_tiles)
        def _tile(j):
            b, n = tile_coords(j)
            valid_rows = block_rows_ref[b]
            width_index = sum(valid_rows > width for width in widths[:-1])  # of the first width >= valid rows
            for k, width in enumerate(widths):
                pl.when(width_index == k)(functools.partial(tile, j, b, n, width))

        plgpu.wait_smem_to_gmem(0)

    for w in range(NUM_COMPUTE):
        pl.when(wg == w)(functools.partial(compute_warpgroup, w))


def _grouped_gemm(
    num_blocks, block_expert, block_row, block_rows, x, w, s, out_type, *, gate_up, block_m, widths, num_sms, interpret
):
    """One of the two GEMMs (see `_kernel`) over the first num_blocks[0] row blocks: block_expert [NB] (row of
    the weight stack), block_row [NB] (first x row), block_rows [NB] (valid rows). As many pipeline stages as fit
    in shared memory, up to 4."""
    stage_bytes = 2 * (STAGE_WORDS * TILE_N * 4 + STAGE_WORDS // 4 * TILE_N * 2) + STAGE_CHUNKS * block_m * CHUNK * 2
    out_dtype = jnp.dtype(out_type.dtype)
    out_tiles = 2 if gate_up else NUM_COMPUTE  # gate_up: the gate warpgroups store h
    up_shape = (2, block_m // 4, 256) if gate_up else (1,)
    fixed_bytes = (
        out_tiles * block_m * WG_N * out_dtype.itemsize
        + 4 * math.prod(up_shape)
        + (NUM_COMPUTE * 64 * CHUNK * 2 if interpret else 0)
        + 2048
    )
    num_stages = min(4, (SMEM_BYTES - fixed_bytes) // stage_bytes)
    scratch = [
        tiled_smem((num_stages, 2, STAGE_WORDS, TILE_N), jnp.int32, 128),  # w_smem [slot, tile]
        plgpu.SMEM((num_stages, 2, STAGE_WORDS // 4, TILE_N), jnp.bfloat16),  # s_smem [slot, tile, group, col]
        tiled_smem((num_stages, STAGE_CHUNKS, block_m, CHUNK), jnp.bfloat16, 128),  # x_smem [slot, chunk]
        (
            tiled_smem((NUM_COMPUTE, 64, CHUNK), jnp.bfloat16, 128) if interpret else plgpu.SMEM((1,), jnp.float32)
        ),  # a_smem
        plgpu.SMEM((out_tiles, block_m, WG_N), out_dtype),  # out_smem
        plgpu.SMEM(up_shape, jnp.float32),  # up_smem: gate_up's up accumulators, `_stash` layout
        plgpu.Barrier(num_arrivals=NUM_COPIES, num_barriers=num_stages),  # full_bars
        plgpu.Barrier(num_arrivals=NUM_COMPUTE, num_barriers=num_stages),  # empty_bars
        plgpu.Barrier(num_arrivals=1, num_barriers=2),  # up_full_bars [column half]
        plgpu.Barrier(num_arrivals=1, num_barriers=2),  # up_empty_bars
    ]
    kernel = plgpu.kernel(
        functools.partial(
            _kernel, gate_up=gate_up, block_m=block_m, widths=widths, num_stages=num_stages, interpret=interpret
        ),
        out_type=out_type,
        scratch_types=scratch,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=NUM_COMPUTE + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return kernel(num_blocks, block_expert, block_row, block_rows, x, w, s)


def gate_up_rows(local_ids, counts, rank, block_expert, block_m, top_k):
    """Where gate_up reads its activations: x rows in sorted pair order, each expert's group padded to 8 rows
    (TMA moves whole 8-row tiles and rounds an unaligned start down), not to block_m as the slots of h are.
    counts, rank: `expert_ranks`; block_expert [num_blocks]: `block_experts`.

    Returns token_of_row [R] int32 (the token whose x fills row r, -1 = zero row; R a multiple of 8) and
    block_row [num_blocks] int32 (multiples of 8): block b reads rows block_row[b] .. + block_m, whose valid
    rows are those of its slots. Rows past its expert's pairs are padding or the next expert's; they land in
    padding slots of h and of down's output, which the combine never reads.
    """
    num_experts, num_pairs = counts.shape[0], local_ids.shape[0]
    slot_start, row_start = group_starts(counts, block_m), group_starts(counts, 8)
    num_rows = -(-(num_pairs + 8 * min(num_experts, num_pairs) + block_m) // 8) * 8
    row = pair_rows(local_ids, row_start, rank, num_rows)
    token_of_row = (
        jnp.full(num_rows, -1, jnp.int32).at[row].set(jnp.arange(num_pairs, dtype=jnp.int32) // top_k, mode="drop")
    )
    expert = jnp.maximum(block_expert, 0)
    first_slot = jnp.arange(block_expert.shape[0], dtype=jnp.int32) * block_m
    block_row = first_slot + jnp.where(block_expert >= 0, row_start[expert] - slot_start[expert], 0)
    return token_of_row, block_row


def default_num_sms():
    """Persistent CTAs: the SM count of the first GPU (132 on an H200 when none is attached, e.g. CPU tests)."""
    device = jax.devices()[0]
    return getattr(device, "core_count", 132) if device.platform == "gpu" else 132


class RoutedOperands(NamedTuple):
    """What the two kernels read besides the weights (NB = `max_blocks` row blocks, the used ones first)."""

    num_blocks: jax.Array  # [1] int32: used row blocks
    block_expert: jax.Array  # [NB] int32: row of the weight stack each block multiplies (-1 = unused)
    x_row: jax.Array  # [NB] int32: first row of xs gate_up reads for each block (`gate_up_rows`)
    xs: jax.Array  # [R, D] bf16: x rows in sorted pair order, P1-permuted
    slot_row: jax.Array  # [NB] int32: first slot (row of h and of down's output) of each block
    pair_slot: jax.Array  # [P] int32: the slot of each pair (-1 for pairs off this shard)
    block_rows: jax.Array  # [NB] int32: valid rows (pairs) of each block, 0 for unused ones


def routed_operands(x, local_ids, num_experts, block_m, top_k, stack_offset=0):
    """RoutedOperands for local expert ids [P] (outside [0, E) = off-shard); block_expert is offset by
    stack_offset (the layer's first row in a stack of layers)."""
    counts, rank = expert_ranks(local_ids, num_experts)
    num_blocks_max = max_blocks(local_ids.shape[0], num_experts, block_m)
    block_expert = block_experts(counts, block_m, num_blocks_max)
    num_blocks = jnp.sum(block_expert >= 0, dtype=jnp.int32)[None]
    token_of_row, x_row = gate_up_rows(local_ids, counts, rank, block_expert, block_m, top_k)
    xs = jnp.where(token_of_row[:, None] >= 0, to_p1_order(x)[jnp.maximum(token_of_row, 0)], 0)
    slot_start = group_starts(counts, block_m)
    pair_slot = pair_rows(local_ids, slot_start, rank, -1)
    slot_row = jnp.arange(num_blocks_max, dtype=jnp.int32) * block_m
    expert = jnp.maximum(block_expert, 0)
    block_rows = jnp.where(block_expert >= 0, jnp.clip(slot_start[expert] + counts[expert] - slot_row, 0, block_m), 0)
    return RoutedOperands(
        num_blocks,
        jnp.where(block_expert >= 0, block_expert + stack_offset, -1),
        x_row,
        xs,
        slot_row,
        pair_slot,
        block_rows,
    )


def wgmma_widths(block_m, step=WIDTH_STEP):
    """The wgmma widths (rows multiplied) a block may take, ascending: multiples of `step` up to block_m, so a
    block multiplies its valid rows rounded up, not all block_m (uniform routing, M = 1024, 32-row blocks: 9.5K
    rows instead of 12.4K). A step that is no wgmma width or does not divide block_m raises: rows past the last
    width would go unmultiplied."""
    if step % 8 or block_m % step:
        raise ValueError(f"width_step must be a multiple of 8 dividing block_m={block_m}, got {step}")
    return tuple(range(step, block_m + 1, step))


def fits(d, i):
    """Whether the kernels take hidden size D and intermediate size I: D whole pairs of down's 128-column weight
    tiles and whole K stages (256 inputs) of gate_up, I whole weight tiles and K stages of down."""
    stage_inputs = STAGE_WORDS * PACK
    return not (d % (2 * TILE_N) or d % stage_inputs or i % TILE_N or i % stage_inputs)


@functools.partial(
    jax.jit, static_argnames=["block_m", "out_dtype", "pair_rows_fp32", "interpret", "num_sms", "width_step"]
)
def fused_moe_mosaic(
    x,
    topk_ids,
    topk_weights,
    w13_packed,
    w13_scale,
    w2_packed,
    w2_scale,
    *,
    expert_offset=0,
    block_m=32,
    out_dtype=None,
    pair_rows_fp32=False,
    interpret=False,
    layer=None,
    num_sms=None,
    width_step=WIDTH_STEP,
):
    """Mosaic GPU fused MoE with the contract of `int4_moe_gemm.fused_moe_reference` (bf16 x only).

    Routing in XLA (`expert_ranks`: pairs grouped by expert without a sort, each group padded to block_m slots);
    the activations are gathered in sorted pair order and P1-permuted, the gate_up epilogue writes h
    P1-permuted, down rounds each pair's row to bf16 (fp32 if pair_rows_fp32: for partial sums over a split
    intermediate dim), and the routing weights and the top-k sum are applied in fp32 by the combine.
    layer: weights stacked per layer ([n, E, ...]), indexed in place. block_m: 16, 32 or 64 rows a block;
    width_step: each block multiplies its valid rows rounded up to a multiple of this (`wgmma_widths`).
    """
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"the Mosaic MoE kernels take bf16 x, got {x.dtype}")
    if block_m not in (16, 32, 64):
        raise ValueError(f"block_m must be 16, 32 or 64, got {block_m}")
    weights, num_experts, stack_offset = flatten_layers((w13_packed, w13_scale, w2_packed, w2_scale), layer)
    check_args(x, topk_ids, topk_weights, *weights)
    d, i = x.shape[1], w13_packed.shape[-1]
    if not fits(d, i):
        raise ValueError(f"D={d} must be a multiple of {2 * TILE_N} and I={i} of {STAGE_WORDS * PACK}")
    num_tokens, top_k = topk_ids.shape
    local_ids = topk_ids.reshape(-1).astype(jnp.int32) - expert_offset
    ops = routed_operands(x, local_ids, num_experts, block_m, top_k, stack_offset)
    common = dict(
        block_m=block_m,
        widths=wgmma_widths(block_m, width_step),
        num_sms=num_sms or default_num_sms(),
        interpret=interpret,
    )
    num_slots = ops.slot_row.shape[0] * block_m
    h = _grouped_gemm(
        ops.num_blocks,
        ops.block_expert,
        ops.x_row,
        ops.block_rows,
        ops.xs,
        *weights[:2],
        jax.ShapeDtypeStruct((num_slots, i), x.dtype),
        gate_up=True,
        **common,
    )
    y_slots = _grouped_gemm(
        ops.num_blocks,
        ops.block_expert,
        ops.slot_row,
        ops.block_rows,
        h,
        *weights[2:],
        jax.ShapeDtypeStruct((num_slots, d), jnp.float32 if pair_rows_fp32 else x.dtype),
        gate_up=False,
        **common,
    )
    return combine(y_slots, ops.pair_slot.reshape(num_tokens, top_k), topk_weights).astype(out_dtype or x.dtype)


def combine(y_slots, pair_slot, topk_weights):
    """Down's rows in slot order y_slots [slots, D] (bf16 or fp32), each pair's slot pair_slot [M, k] (-1 = off
    this shard) -> y [M, D] f32: per token, the sum over its top k of the routing weight times its pair's row.
    One elementwise pass over k gathered rows a token (no [M * k, D] intermediate)."""
    weights = topk_weights.astype(jnp.float32)
    terms = [
        jnp.where(pair_slot[:, j : j + 1] >= 0, weights[:, j : j + 1] * y_slots[jnp.maximum(pair_slot[:, j], 0)], 0.0)
        for j in range(pair_slot.shape[1])
    ]
    return functools.reduce(jnp.add, terms)
