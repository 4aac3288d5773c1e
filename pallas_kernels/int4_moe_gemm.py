"""Fused MoE over INT4 (W4A16, group-32) experts: Pallas-Triton kernels, jnp reference, wrappers.

Layout (compressed-tensors pack-quantized, transposed to K-major with N contiguous):
    w13_packed [E, D/8, 2, I] int32   w13_scale [E, D/32, 2, I] bf16   ('2' axis: 0 = gate, 1 = up)
    w2_packed  [E, I/8, D]    int32   w2_scale  [E, I/32, D]    bf16
Each int32 word holds 8 offset-binary nibbles along K, LSB first: input row 8j+k is nibble k of word j,
and its value is q = nibble - 8 in [-8, 7]. The dequantized weight is bf16(q * scale), rounded once as
compressed-tensors does, then cast to the activation dtype.
"""
import jax
import jax.numpy as jnp

GROUP = 32  # input rows per scale
PACK = 8  # nibbles per int32 word


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


def _check_args(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale):
    """Validates shapes/dtypes; returns (E, D, I)."""
    if x.ndim != 2:
        raise ValueError(f"x must be [M, D], got shape {x.shape}")
    m, d = x.shape
    if topk_ids.ndim != 2 or topk_ids.shape[0] != m or not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise ValueError(f"topk_ids must be integer [M={m}, k], got {topk_ids.shape} {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights shape {topk_weights.shape} != topk_ids shape {topk_ids.shape}")
    if w13_packed.ndim != 4 or w13_packed.shape[1:3] != (d // PACK, 2) or w13_packed.dtype != jnp.int32:
        raise ValueError(f"w13_packed must be int32 [E, D/8={d // PACK}, 2, I], got {w13_packed.shape} {w13_packed.dtype}")
    e, _, _, i = w13_packed.shape
    if d % GROUP or i % GROUP:
        raise ValueError(f"D={d} and I={i} must be multiples of {GROUP}")
    if w13_scale.shape != (e, d // GROUP, 2, i):
        raise ValueError(f"w13_scale must be [E, D/32, 2, I]={(e, d // GROUP, 2, i)}, got {w13_scale.shape}")
    if w2_packed.shape != (e, i // PACK, d) or w2_packed.dtype != jnp.int32:
        raise ValueError(f"w2_packed must be int32 [E, I/8, D]={(e, i // PACK, d)}, got {w2_packed.shape} {w2_packed.dtype}")
    if w2_scale.shape != (e, i // GROUP, d):
        raise ValueError(f"w2_scale must be [E, I/32, D]={(e, i // GROUP, d)}, got {w2_scale.shape}")
    return e, d, i


def fused_moe_reference(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, *,
                        expert_offset=0):
    """Plain-jnp fused MoE. x [M, D], topk_ids [M, k] int, topk_weights [M, k] -> y [M, D] (x.dtype).

    y[m] = sum_j topk_weights[m, j] * down_e(silu(gate_e(x[m])) * up_e(x[m])), e = topk_ids[m, j] - expert_offset;
    ids outside [expert_offset, expert_offset + E) contribute nothing. Scans over the E local experts (one
    dequantized expert live at a time) and combines with a per-token coefficient, so memory stays O(M*D + D*I).
    """
    _check_args(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale)
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
    return y.astype(x.dtype)
