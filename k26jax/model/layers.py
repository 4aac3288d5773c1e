"""Building blocks of the K2 decoder as pure functions: RMSNorm, YaRN rope, MLA, router, MLPs.

Shape letters: B batch, T tokens, S cache rows, D hidden, H heads, Rq q_lora, R kv_lora, Dn/Dr/Dv the nope/rope/v
head dims, I an intermediate dim, E experts, k experts per token. Matmuls accumulate in fp32; norm statistics,
softmax and router scores are fp32 (DESIGN.md, Numerics).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from k26jax import ops
from k26jax.config import ModelConfig, yarn_mscale

F32 = jnp.float32


# On the GPU a dot of fewer rows is lowered to XLA's own kernel, which copies a weight sliced out of a layer stack
# (ops.COMPILER_OPTIONS); the dense dots below pad their rows up to this many so cuBLAS reads the slice in place.
GPU_MIN_ROWS = 8


def pad_rows(x, rows_per_item: int = 1):
    """x with its leading axis zero-padded so that it holds at least GPU_MIN_ROWS rows (leading size x
    rows_per_item), on the GPU only; slice the result back with [:x.shape[0]]."""
    need = -(-GPU_MIN_ROWS // rows_per_item)
    if jax.default_backend() != "gpu" or x.shape[0] >= need:
        return x
    return jnp.pad(x, [(0, need - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def mm(subscripts: str, x, w, out_dtype=None, precision=None):
    """einsum with fp32 accumulation, returned in out_dtype (x's dtype by default). x and the result are
    [B, T, ...] (leading rows padded on the GPU, see GPU_MIN_ROWS). w is cast to x's dtype.

    w may be an ops.LayerWeight (a layer scan's weight): a dot "bt<X>,<X><Y>->bt<Y>" of few enough rows then
    runs as ops.dense_gemm, which reads the layer inside its stack; its fp32 products and sums meet any
    `precision` asked.

    XLA:CPU has no bf16 x bf16 -> f32 batched-dot thunk, so on the CPU the operands are upcast first; that is
    exact, since a product of two bf16 values is representable in f32.
    """
    out_dtype = out_dtype or x.dtype
    if isinstance(w, ops.LayerWeight):
        y = _layer_gemm(subscripts, x, w, out_dtype)
        if y is not None:
            return y
        w = w.get()
    w = w.astype(x.dtype)
    if jax.default_backend() == "cpu" and x.dtype == jnp.bfloat16:
        return jnp.einsum(subscripts, x.astype(F32), w.astype(F32), precision=precision).astype(out_dtype)
    padded = pad_rows(x, x.shape[1])
    out = jnp.einsum(subscripts, padded, w, preferred_element_type=F32, precision=precision).astype(out_dtype)
    return out[: x.shape[0]]


def _layer_gemm(subscripts: str, x, w: ops.LayerWeight, out_dtype):
    """mm as ops.dense_gemm over [B*T, K] x [L, K, N] views, or None where that does not apply."""
    ins, out = subscripts.split("->")
    a, b = ins.split(",")
    contract = a[2:]
    if not (a[:2] == out[:2] and b.startswith(contract) and out[2:] == b[len(contract) :]):
        return None
    B, T = x.shape[:2]
    K = int(np.prod(x.shape[2:]))
    view = dataclasses.replace(w, stack=w.stack.reshape(w.stack.shape[0], K, -1))
    y = ops.dense_gemm(x.reshape(B * T, K), view, out_dtype)
    return None if y is None else y.reshape(B, T, *w.stack.shape[1 + len(contract) :])


def rms_norm(x, weight, eps: float):
    """HF DeepseekV3RMSNorm: normalise in fp32, cast back to x.dtype, then scale."""
    xf = x.astype(F32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


# ---- rope ------------------------------------------------------------------------------------------------
def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [Dr/2] float32, cos/sin multiplier) following HF's default / YaRN rope parameters."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv_extra = (1.0 / pos_freqs).astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_extra, 1.0
    inv_inter = (1.0 / (rs.factor * pos_freqs)).astype(np.float32)

    def correction_dim(rot):
        return (dim * math.log(rs.original_max_position_embeddings / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_freq = inv_inter * (1 - extrapolation) + inv_extra * extrapolation
    attention_factor = (
        yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
        if rs.mscale_all_dim
        else yarn_mscale(rs.factor)
    )
    return inv_freq.astype(np.float32), float(attention_factor)


def apply_rope(x, positions, inv_freq, attention_factor: float):
    """Rotate interleaved pairs (x[2i], x[2i+1]) by positions * inv_freq[i].

    x [..., T, (heads,) Dr] with positions broadcastable to [..., T]. The output is in half layout
    [rotated evens, rotated odds], as HF's apply_rotary_pos_emb_interleave returns; q and k share it.
    """
    freqs = positions.astype(F32)[..., None] * jnp.asarray(inv_freq)
    cos, sin = jnp.cos(freqs) * attention_factor, jnp.sin(freqs) * attention_factor
    if x.ndim == freqs.ndim + 1:
        cos, sin = cos[..., None, :], sin[..., None, :]
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1)


# ---- MLA -------------------------------------------------------------------------------------------------
def mla_queries(attn, x_BTD, positions_BT, cfg: ModelConfig, rope):
    """q_nope [B,T,H,Dn] and roped q_pe [B,T,H,Dr]."""
    if cfg.q_lora_rank is None:
        q = mm("btd,dhq->bthq", x_BTD, attn["q"])
    else:
        cq = rms_norm(mm("btd,dr->btr", x_BTD, attn["q_a"]), attn["q_a_norm"], cfg.latent_norm_eps)
        q = mm("btr,rhq->bthq", cq, attn["q_b"])
    q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
    return q_nope, apply_rope(q_pe, positions_BT, *rope)


def mla_latent_rows(attn, x_BTD, positions_BT, cfg: ModelConfig, rope):
    """The latent-cache rows of these tokens: [B,T,R+Dr] = [kv_a-normed c_kv, roped k_pe]."""
    kv = mm("btd,dc->btc", x_BTD, attn["kv_a"])
    c_kv = rms_norm(kv[..., : cfg.kv_lora_rank], attn["kv_a_norm"], cfg.latent_norm_eps)
    k_pe = apply_rope(kv[..., cfg.kv_lora_rank :], positions_BT, *rope)
    return jnp.concatenate([c_kv, k_pe], axis=-1)


def mla_naive(attn, x_BTD, positions_BT, valid_BT, cfg: ModelConfig, rope):
    """Expanded MLA over the tokens themselves with a causal mask (prefill). Returns (out [B,T,D], rows)."""
    q_nope, q_pe = mla_queries(attn, x_BTD, positions_BT, cfg, rope)
    rows = mla_latent_rows(attn, x_BTD, positions_BT, cfg, rope)
    c_kv, k_pe = rows[..., : cfg.kv_lora_rank], rows[..., cfg.kv_lora_rank :]
    k_nope = mm("bsr,hnr->bshn", c_kv, attn["w_uk"])
    v = mm("bsr,hvr->bshv", c_kv, attn["w_uv"])
    scores = (
        jnp.einsum("bthn,bshn->bhts", q_nope, k_nope, preferred_element_type=F32)
        + jnp.einsum("bthr,bsr->bhts", q_pe, k_pe, preferred_element_type=F32)
    ) * cfg.softmax_scale
    T = x_BTD.shape[1]
    mask = jnp.tril(jnp.ones((T, T), bool))[None] & valid_BT[:, None, :]
    scores = jnp.where(mask[:, None], scores, jnp.finfo(F32).min)
    p = jax.nn.softmax(scores, axis=-1).astype(x_BTD.dtype)
    o = jnp.einsum("bhts,bshv->bthv", p, v, preferred_element_type=F32).astype(x_BTD.dtype)
    return mm("bthv,hvd->btd", o, attn["o"]), rows


def mla_absorbed_queries(attn, x_BTD, positions_BT, cfg: ModelConfig, rope):
    """q_lat [B,T,H,R] = q_nope . W_UK and roped q_pe [B,T,H,Dr]: the queries the latent attention takes."""
    q_nope, q_pe = mla_queries(attn, x_BTD, positions_BT, cfg, rope)
    return mm("bthn,hnr->bthr", q_nope, attn["w_uk"]), q_pe


def mla_absorbed_output(attn, o_lat_BTHR):
    """o = (o_lat . W_UV^T) . W_O -> [B,T,D]."""
    o = mm("bthr,hvr->bthv", o_lat_BTHR, attn["w_uv"])
    return mm("bthv,hvd->btd", o, attn["o"])


# ---- MLPs and routing ------------------------------------------------------------------------------------
def swiglu_mlp(mlp, x_BTD):
    """down(silu(x W_gate) * (x W_up)) with gate_up [D, 2, I]."""
    gu = mm("btd,dgi->btgi", x_BTD, mlp["gate_up"])
    h = jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]
    return mm("bti,id->btd", h, mlp["down"])


def route(router_kernel_DE, router_bias_E, x_ND, cfg: ModelConfig):
    """HF DeepseekV3TopkRouter + get_topk_indices: (topk_ids [N,k] int32, topk_weights [N,k] f32).

    Selection uses sigmoid scores plus the correction bias, group-limited when n_group > 1 (groups ranked by the
    sum of their top-2 biased scores; experts of dropped groups masked to -inf, as HF's masked_fill does). The
    weights are the unbiased scores, normalised when norm_topk_prob, then times routed_scaling_factor.
    """
    # fp32 logits: bf16 x bf16 products are exact in fp32, so this equals HF's fp32 linear up to summation order,
    # without an fp32 copy of the router weights every step
    logits = mm("bnd,de->bne", x_ND[None], router_kernel_DE, out_dtype=F32, precision=jax.lax.Precision.HIGHEST)[0]
    scores = jax.nn.sigmoid(logits)
    biased = scores + router_bias_E.astype(F32)
    if cfg.n_group > 1:
        n, e = biased.shape
        grouped = biased.reshape(n, cfg.n_group, e // cfg.n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)
        _, keep = jax.lax.top_k(group_scores, cfg.topk_group)
        group_mask = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], keep].set(True)
        biased = jnp.where(jnp.repeat(group_mask, e // cfg.n_group, axis=1), biased, -jnp.inf)
    _, topk_ids = jax.lax.top_k(biased, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, topk_ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return topk_ids.astype(jnp.int32), weights * cfg.routed_scaling_factor
