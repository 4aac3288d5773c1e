"""INT4 group-32 quantization of trained routed experts into k26jax's layout, and its fake-quant for QAT.

Layout (the model's, see k26jax/model/target.py): gate/up w13 [E, D, 2, I] -> w13_packed [E, D/8, 2, I] int32 and
w13_scale [E, D/32, 2, I] bf16; down w2 [E, I, D] -> w2_packed [E, I/8, D], w2_scale [E, I/32, D]. Groups and
packing run along the input dim K (D for w13, I for w2): input row 8j+k is nibble k of word j, offset binary
(q + 8), LSB first -- compressed-tensors' pack-quantized words, transposed to K-major. Dequantized weights are
bf16(q * scale), as compressed-tensors and the model compute them.

Scales: per group, the bf16 scale among absmax / c (c on a grid over [6, 8]) with the least squared error, so a
group may clip its largest value when that lowers the error; q = clip(round(w / scale), -8, 7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP = 32
PACK = 8
QMIN, QMAX = -8, 7
DIVISORS = tuple(6.0 + 0.125 * i for i in range(17))


def _grouped(w, axis: int):
    """w with `axis` split into [K/32, 32] and the group axis moved last: [..., K/32, 32]."""
    w = jnp.moveaxis(w, axis, -1)
    if w.shape[-1] % GROUP:
        raise ValueError(f"axis {axis} has {w.shape[-1]} entries, not a multiple of the group {GROUP}")
    return w.reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)


def _ungrouped(g, axis: int):
    return jnp.moveaxis(g.reshape(*g.shape[:-2], -1), -1, axis)


def _round_bf16(x):
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)


def quantize(w, axis: int):
    """(q int8 [w.shape], scale bf16 [w.shape with axis / 32]) for float w grouped by 32 along `axis`."""
    g = _grouped(w.astype(jnp.float32), axis)
    absmax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    best_err, best_scale = None, None
    for c in DIVISORS:
        scale = jnp.maximum(_round_bf16(absmax / c), jnp.finfo(jnp.bfloat16).tiny)
        q = jnp.clip(jnp.round(g / scale), QMIN, QMAX)
        err = jnp.sum((_round_bf16(q * scale) - g) ** 2, axis=-1, keepdims=True)
        if best_err is None:
            best_err, best_scale = err, scale
        else:
            better = err < best_err
            best_err, best_scale = jnp.where(better, err, best_err), jnp.where(better, scale, best_scale)
    q = jnp.clip(jnp.round(g / best_scale), QMIN, QMAX).astype(jnp.int8)
    return _ungrouped(q, axis), jnp.moveaxis(best_scale[..., 0], -1, axis).astype(jnp.bfloat16)


def dequantize(q, scale, axis: int, dtype=jnp.float32):
    """bf16(q * scale) in `dtype`; scale has K/32 entries along `axis` where q has K."""
    s = jnp.repeat(scale.astype(jnp.float32), GROUP, axis=axis)
    return _round_bf16(q.astype(jnp.float32) * s).astype(dtype)


def pack(q, axis: int):
    """int values in [-8, 7] -> int32 words, `axis` shrinks 8x (row 8j+k is nibble k of word j)."""
    q = jnp.moveaxis(q, axis, -1)
    nibbles = (q.astype(jnp.int32) - QMIN).astype(jnp.uint32).reshape(*q.shape[:-1], -1, PACK)
    words = jnp.sum(nibbles << (4 * jnp.arange(PACK, dtype=jnp.uint32)), axis=-1, dtype=jnp.uint32)
    return jnp.moveaxis(jax.lax.bitcast_convert_type(words, jnp.int32), -1, axis)


def unpack(words, axis: int):
    """int32 words -> int8 values in [-8, 7]; `axis` grows 8x."""
    w = jnp.moveaxis(words, axis, -1)[..., None]
    nibbles = (w >> (4 * jnp.arange(PACK, dtype=jnp.int32))) & 0xF
    return jnp.moveaxis((nibbles + QMIN).astype(jnp.int8).reshape(*w.shape[:-2], -1), -1, axis)


def quantize_experts(w13_EDGI, w2_EID) -> dict:
    """Float experts of one or more layers (leading dims allowed) -> the four packed leaves of the model."""
    k13, k2 = w13_EDGI.ndim - 3, w2_EID.ndim - 2  # the input (K) axes: D of [.., D, 2, I], I of [.., I, D]
    q13, s13 = quantize(w13_EDGI, k13)
    q2, s2 = quantize(w2_EID, k2)
    return dict(w13_packed=pack(q13, k13), w13_scale=s13, w2_packed=pack(q2, k2), w2_scale=s2)


def dequantize_experts(experts: dict, dtype=jnp.float32):
    """The four packed leaves -> (w13 [.., E, D, 2, I], w2 [.., E, I, D]) as bf16(q * scale) in `dtype`."""
    k13, k2 = experts["w13_packed"].ndim - 3, experts["w2_packed"].ndim - 2
    w13 = dequantize(unpack(experts["w13_packed"], k13), experts["w13_scale"], k13, dtype)
    w2 = dequantize(unpack(experts["w2_packed"], k2), experts["w2_scale"], k2, dtype)
    return w13, w2


def fake_quant(w, axis: int):
    """Quantize-dequantize in the forward pass, identity in the backward pass (straight-through)."""
    q, s = quantize(jax.lax.stop_gradient(w), axis)
    return w + jax.lax.stop_gradient(dequantize(q, s, axis, w.dtype) - w)
