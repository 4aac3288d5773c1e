"""Few-row dense GEMM y [M, N] = x [M, K] @ w [K, N] (M up to MAX_ROWS), reading one layer of a weight stack in
place: the jnp reference, the Pallas-Triton kernel, and `few_row_gemm`.

At decode, a dense layer's dots have 1-64 rows and are bound by reading the weight; cuBLAS ran each of one TP-8
share's in ~9.5 us whatever its size (an H100 trace), and a weight sliced out of its layer stack in front of a
custom call is copied. This kernel splits K as well as N, so that about TARGET_PROGRAMS programs stream the
weight, and indexes the layer inside the stack. Each K split writes fp32 partial sums; their sum (fixed order,
so deterministic) is one small XLA reduction. Products are exact in fp32 for bf16 inputs (fp32 inputs: IEEE fp32
dots), sums are fp32.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_ROWS = 64
MAX_ELEMENTS = 2**31  # Triton's offsets are int32
TARGET_PROGRAMS = 264  # two per SM of an H100 / H200 (132 SMs)
BLOCK_K = 64


def _check_args(x_MK, w, layer):
    if x_MK.ndim != 2 or x_MK.shape[0] > MAX_ROWS:
        raise ValueError(f"x must be [M, K] with M <= {MAX_ROWS}, got shape {x_MK.shape}")
    if w.ndim != (2 if layer is None else 3) or w.shape[-2] != x_MK.shape[1]:
        want = "[K, N]" if layer is None else "the stack [L, K, N] (with layer=)"
        raise ValueError(f"w must be {want} with K = {x_MK.shape[1]}, got shape {w.shape}")
    if w.size >= MAX_ELEMENTS:
        raise ValueError(f"w {w.shape} has {w.size} elements: the kernel's int32 offsets reach {MAX_ELEMENTS}")
    if layer is not None and (jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.result_type(layer), jnp.integer)):
        raise ValueError(f"layer must be an integer scalar, got {jnp.result_type(layer)}{jnp.shape(layer)}")


def few_row_gemm_reference(x_MK, w, *, layer=None, out_dtype=None):
    """x [M, K] @ w [K, N] (or layer `layer` of the stack w [L, K, N]) with fp32 products and sums, w cast to x's
    dtype first; returned in out_dtype (x's dtype by default)."""
    _check_args(x_MK, w, layer)
    if layer is not None:
        w = jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
    w = w.astype(x_MK.dtype).astype(jnp.float32)
    y = jnp.dot(x_MK.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype or x_MK.dtype)


def plan(M, K, N, programs=TARGET_PROGRAMS):
    """(rows padded for the dot, block_n, K splits, K blocks a split) for these sizes: about `programs` programs."""
    rows = max(16, pl.next_power_of_2(M))
    block_n = 64 if N % 128 and N % 64 == 0 else 128
    k_blocks = pl.cdiv(K, BLOCK_K)
    splits = max(1, min(k_blocks, round(programs / pl.cdiv(N, block_n))))
    steps = pl.cdiv(k_blocks, splits)
    return rows, block_n, pl.cdiv(k_blocks, steps), steps


def _kernel(layer_ref, x_ref, w_ref, part_ref, *, M, K, N, rows, block_n, steps):
    n, s = pl.program_id(0), pl.program_id(1)
    r = jnp.arange(rows)
    cols = n * block_n + jnp.arange(block_n)
    layer_row = layer_ref[0] * K
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def body(i, acc):
        k0 = (s * steps + i) * BLOCK_K
        ks = k0 + jnp.arange(BLOCK_K)
        x = plgpu.load(x_ref.at[pl.ds(0, rows), pl.ds(k0, BLOCK_K)], mask=(r[:, None] < M) & (ks[None] < K), other=0)
        w = plgpu.load(
            w_ref.at[pl.ds(layer_row + k0, BLOCK_K), pl.ds(n * block_n, block_n)],
            mask=(ks[:, None] < K) & (cols[None] < N),
            other=0,
        )
        return acc + jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32, precision=precision)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((rows, block_n), jnp.float32))
    plgpu.store(
        part_ref.at[s, pl.ds(0, rows), pl.ds(n * block_n, block_n)], acc, mask=(r[:, None] < M) & (cols[None] < N)
    )


@functools.partial(jax.jit, static_argnames=("out_dtype", "programs", "interpret"))
def few_row_gemm(x_MK, w, *, layer=None, out_dtype=None, programs=TARGET_PROGRAMS, interpret=False):
    """`few_row_gemm_reference` as one Pallas-Triton kernel over (N blocks, K splits) plus the sum of the splits.
    With `layer` (an integer scalar, may be traced) w is the stack [L, K, N], viewed as [L*K, N] (a free
    reshape): the kernel reads layer `layer` where it lies. programs: about how many programs (see `plan`)."""
    _check_args(x_MK, w, layer)
    (M, K), N = x_MK.shape, w.shape[-1]
    rows, block_n, splits, steps = plan(M, K, N, programs)
    layer_1 = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    part = pl.pallas_call(
        functools.partial(_kernel, M=M, K=K, N=N, rows=rows, block_n=block_n, steps=steps),
        out_shape=jax.ShapeDtypeStruct((splits, M, N), jnp.float32),
        grid=(pl.cdiv(N, block_n), splits),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=4),
        interpret=interpret,
        name="few_row_gemm",
    )(layer_1, x_MK, w.reshape(-1, N))
    return part.sum(axis=0).astype(out_dtype or x_MK.dtype)
