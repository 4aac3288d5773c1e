"""The DFlash drafter (z-lab `DFlashDraftModel`, dflash 0.1.0) in Flax NNX: pure functions the engine jits, and a
module whose methods run them on its own parameters.

Qwen3 decoder layers (pre-norm, per-head q/k RMSNorm, GQA, rotate-half rope, SwiGLU) with KV injection: every
layer's keys and values come from [context ; block], its queries from the block only, attention non-causal.
  context  ctx = hidden_norm(fc(concat of the target's hidden states at target_layer_ids)), the same for every
           layer; per layer k = rope(k_norm(ctx W_k)), v = ctx W_v (no input_layernorm on the context part).
  block    embed([bonus, MASK x (b-1)]) * input_embedding_scale, through the layers; the block's own k/v use the
           layer's input_layernorm output like its queries.
  output   target lm_head(norm(h)) on rows 1..b-1, times output_multiplier, then softcapped when configured.
The drafter has no embedding or lm_head of its own: it borrows the target's (embed_VD [V, D], lm_head_DV [D, V]).

The parameter tree (= `DFlashDrafter(...).params()`) is declared in k26jax/model/params.py (`drafter_table`).
The compute dtype is the parameters' (bf16 by default, float32 for exactness tests); matmuls accumulate in fp32,
norm statistics and softmax are fp32, logits are returned in float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from k26jax.config import DrafterConfig, DrafterRope
from k26jax.model import params as param_table
from k26jax.model.layers import F32, mm, rms_norm, swiglu_mlp
from k26jax.model.params import DATA, MODEL


# ---- module (random init; checkpoints overwrite the state) -----------------------------------------------
class DFlashDrafter(nnx.Module):
    """The drafter: its Params are `params.drafter_table(cfg)`, its methods run the forward (`context_kv`,
    `draft_block`, `draft_logits`) through the module-level functions below, on the module's pure parameter tree."""

    def __init__(self, cfg: DrafterConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.cfg = cfg
        param_table.build(self, param_table.drafter_table(cfg), dtype, rngs)

    @classmethod
    def from_params(cls, cfg: DrafterConfig, tree: dict) -> DFlashDrafter:
        """A module holding `tree` (e.g. from k26jax.hf.read_drafter), without a random init."""
        module = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
        param_table.load_into(module, tree)
        return module

    def params(self) -> dict:
        return param_table.pure_params(self)

    def context_kv(self, context_features, positions):
        return context_kv(self.params(), self.cfg, context_features, positions)

    def draft_block(self, embed_VD, lm_head_DV, ctx_k, ctx_v, ctx_len, bonus_ids, start):
        return draft_block(self.params(), self.cfg, embed_VD, lm_head_DV, ctx_k, ctx_v, ctx_len, bonus_ids, start)

    def draft_logits(self, embed_VD, lm_head_DV, context_features, bonus_ids):
        return draft_logits(self.params(), self.cfg, embed_VD, lm_head_DV, context_features, bonus_ids)

    def __call__(self, embed_VD, lm_head_DV, context_features, bonus_ids):
        return self.draft_logits(embed_VD, lm_head_DV, context_features, bonus_ids)


def init_params(cfg: DrafterConfig, seed: int = 0, dtype=jnp.bfloat16) -> dict:
    return DFlashDrafter(cfg, dtype=dtype, rngs=nnx.Rngs(seed)).params()


def abstract_params(cfg: DrafterConfig, dtype=jnp.bfloat16) -> dict:
    """The parameter tree as ShapeDtypeStructs, without allocating it."""
    return nnx.eval_shape(lambda: DFlashDrafter(cfg, dtype=dtype, rngs=nnx.Rngs(0))).params()


# ---- rope (HF Qwen3RotaryEmbedding: rotate-half, cos/sin times attention_factor) -------------------------
def rope_inv_freq(rope: DrafterRope, head_dim: int) -> np.ndarray:
    """inv_freq [head_dim/2] float32, computed in float32 as HF does (default or YaRN)."""
    dim, base = head_dim, rope.theta
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    # float32 pow rounded from float64: matches torch's float32 pow where numpy's float32 pow is 1 ulp off.
    pos_freqs = (np.float64(base) ** exponents.astype(np.float64)).astype(np.float32)
    inv_extrapolation = (1.0 / pos_freqs).astype(np.float32)
    if rope.kind == "default":
        return inv_extrapolation
    inv_interpolation = (1.0 / (rope.factor * pos_freqs)).astype(np.float32)

    def correction_dim(rotations):
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = (1 - ramp).astype(np.float32)
    return (inv_interpolation * (1 - extrapolation) + inv_extrapolation * extrapolation).astype(np.float32)


def rope_cos_sin(cfg: DrafterConfig, positions):
    """cos, sin [..., head_dim] float32 for integer positions [...]."""
    freqs = positions.astype(F32)[..., None] * jnp.asarray(rope_inv_freq(cfg.rope, cfg.head_dim))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * cfg.rope.attention_factor, jnp.sin(emb) * cfg.rope.attention_factor


def _apply_rope(x_BTNK, cos_BTK, sin_BTK):
    cos, sin = cos_BTK[..., None, :].astype(x_BTNK.dtype), sin_BTK[..., None, :].astype(x_BTNK.dtype)
    half = x_BTNK.shape[-1] // 2
    rotated = jnp.concatenate([-x_BTNK[..., half:], x_BTNK[..., :half]], axis=-1)
    return x_BTNK * cos + rotated * sin


# ---- layer pieces ------------------------------------------------------------------------------------------
def layer_kv(attn, cfg: DrafterConfig, x_BTD, cos_BTK, sin_BTK):
    """One layer's roped k and v, head-major [B,Hkv,T,K] as the context cache holds them, for hidden rows x
    (context rows or the normed block)."""
    k = rms_norm(mm("btd,dmk->btmk", x_BTD, attn["k"]), attn["k_norm"], cfg.rms_norm_eps)
    head_major = lambda x: x.transpose(0, 2, 1, 3)
    return head_major(_apply_rope(k, cos_BTK, sin_BTK)), head_major(mm("btd,dmk->btmk", x_BTD, attn["v"]))


def _attend(q_BQNK, k_ctx_BMSK, v_ctx_BMSK, k_blk_BMbK, v_blk_BMbK, visible_BS=None):
    """GQA softmax attention over context rows plus the block (query head n uses kv head n // q_per_kv), fp32
    scores and softmax. The two key sets are scored apart and share one softmax, so the context cache is read
    where it lies (head-major: each head's rows are one [S, K] slab) instead of concatenated with the block."""
    B, Q, N, K = q_BQNK.shape
    M = k_ctx_BMSK.shape[1]
    q = q_BQNK.reshape(B, Q, M, N // M, K)
    s_ctx = jnp.einsum("bqmgk,bmsk->bmgqs", q, k_ctx_BMSK, preferred_element_type=F32) * K**-0.5
    if visible_BS is not None:
        s_ctx = jnp.where(visible_BS[:, None, None, None, :], s_ctx, -jnp.inf)
    s_blk = jnp.einsum("bqmgk,bmtk->bmgqt", q, k_blk_BMbK, preferred_element_type=F32) * K**-0.5
    m = jnp.maximum(s_ctx.max(-1, keepdims=True), s_blk.max(-1, keepdims=True))  # finite: the block is seen
    e_ctx, e_blk = jnp.exp(s_ctx - m), jnp.exp(s_blk - m)
    denom = e_ctx.sum(-1, keepdims=True) + e_blk.sum(-1, keepdims=True)
    p_ctx, p_blk = (e_ctx / denom).astype(v_ctx_BMSK.dtype), (e_blk / denom).astype(v_blk_BMbK.dtype)
    # batch dims first in the output: XLA CPU rejects this bf16 x bf16 -> f32 dot written straight to [b,q,m,g,k]
    o_BMGQK = jnp.einsum("bmgqs,bmsk->bmgqk", p_ctx, v_ctx_BMSK, preferred_element_type=F32) + jnp.einsum(
        "bmgqt,bmtk->bmgqk", p_blk, v_blk_BMbK, preferred_element_type=F32
    )
    return o_BMGQK.astype(q_BQNK.dtype).transpose(0, 3, 1, 2, 4).reshape(B, Q, N, K)


def decoder_layer(layer, cfg: DrafterConfig, h_BbD, cos_BbK, sin_BbK, attend):
    """One pre-norm decoder layer over the block; attend(q, k_block, v_block) adds the context keys."""
    attn = layer["attn"]
    x = rms_norm(h_BbD, layer["input_norm"], cfg.rms_norm_eps)
    q = rms_norm(mm("btd,dnk->btnk", x, attn["q"]), attn["q_norm"], cfg.rms_norm_eps)
    q = _apply_rope(q, cos_BbK, sin_BbK)
    k_block, v_block = layer_kv(attn, cfg, x, cos_BbK, sin_BbK)
    h = h_BbD + mm("btnk,nkd->btd", attend(q, k_block, v_block), attn["o"])
    return h + swiglu_mlp(layer["mlp"], rms_norm(h, layer["post_attn_norm"], cfg.rms_norm_eps))


def fused_context(params, cfg: DrafterConfig, context_features_BTF):
    _check_last_dim(context_features_BTF, cfg.context_dim, "context_features")
    x = context_features_BTF.astype(params["fc"].dtype)
    return rms_norm(mm("btf,fd->btd", x, params["fc"]), params["hidden_norm"], cfg.rms_norm_eps)


def _block_embeddings(params, cfg: DrafterConfig, embed_VD, bonus_ids_B):
    """embed([bonus, MASK x (b-1)]) * input_embedding_scale -> [B, b, D] in the parameters' dtype."""
    if embed_VD.ndim != 2 or embed_VD.shape[1] != cfg.hidden_size:
        raise ValueError(f"embed_VD: expected [V, {cfg.hidden_size}], got {embed_VD.shape}")
    if bonus_ids_B.ndim != 1:
        raise ValueError(f"bonus_ids: expected [B], got {bonus_ids_B.shape}")
    ids = jnp.full((bonus_ids_B.shape[0], cfg.block_size), cfg.mask_token_id, jnp.int32)
    ids = ids.at[:, 0].set(bonus_ids_B.astype(jnp.int32))
    return (embed_VD[ids] * cfg.input_embedding_scale).astype(params["fc"].dtype)


def block_logits(params, cfg: DrafterConfig, lm_head_DV, h_BbD):
    """Rows 1..b-1: lm_head(norm(h)) * output_multiplier, softcapped -> float32 [B, b-1, V]."""
    if lm_head_DV.ndim != 2 or lm_head_DV.shape[0] != cfg.hidden_size:
        raise ValueError(f"lm_head_DV: expected [{cfg.hidden_size}, V], got {lm_head_DV.shape}")
    x = rms_norm(h_BbD[:, 1:], params["final_norm"], cfg.rms_norm_eps)
    logits = mm("btd,dv->btv", x, lm_head_DV, out_dtype=F32)
    logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping is not None:
        logits = jnp.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


def _check_last_dim(x, want: int, name: str):
    if x.ndim != 3 or x.shape[-1] != want:
        raise ValueError(f"{name}: expected [B, T, {want}], got {x.shape}")


# ---- public functions ------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames="cfg")
def draft_logits(params, cfg: DrafterConfig, embed_VD, lm_head_DV, context_features, bonus_ids):
    """Full forward, no cache: context_features [B,Tc,F] at positions 0..Tc-1, bonus_ids [B] -> [B, b-1, V] f32.

    The block [bonus, MASK x (b-1)] sits at positions Tc..Tc+b-1 and attends to all context rows and itself.
    """
    return block_logits(params, cfg, lm_head_DV, _full_forward(params, cfg, embed_VD, context_features, bonus_ids)[-1])


@functools.partial(jax.jit, static_argnames="cfg")
def draft_hidden_states(params, cfg: DrafterConfig, embed_VD, context_features, bonus_ids):
    """draft_logits' hidden states: (each layer's output [n, B, b, D], the final-normed block [B, b, D])."""
    h_layers = _full_forward(params, cfg, embed_VD, context_features, bonus_ids)
    return h_layers, rms_norm(h_layers[-1], params["final_norm"], cfg.rms_norm_eps)


def _full_forward(params, cfg: DrafterConfig, embed_VD, context_features, bonus_ids):
    """Every layer's block output [n, B, b, D], context at positions 0..Tc-1 and the block after it."""
    ctx_BTD = fused_context(params, cfg, context_features)
    B, Tc, _ = ctx_BTD.shape
    h = _block_embeddings(params, cfg, embed_VD, bonus_ids)
    if h.shape[0] != B:
        raise ValueError(f"bonus_ids: batch {h.shape[0]} != context_features batch {B}")
    cos, sin = rope_cos_sin(cfg, jnp.broadcast_to(jnp.arange(Tc + cfg.block_size), (B, Tc + cfg.block_size)))

    def body(h, layer):
        k_ctx, v_ctx = layer_kv(layer["attn"], cfg, ctx_BTD, cos[:, :Tc], sin[:, :Tc])
        attend = lambda q, k, v: _attend(q, k_ctx, v_ctx, k, v)
        h = decoder_layer(layer, cfg, h, cos[:, Tc:], sin[:, Tc:], attend)
        return h, h

    return jax.lax.scan(body, h, params["layers"])[1]


@functools.partial(jax.jit, static_argnames="cfg")
def context_kv(params, cfg: DrafterConfig, context_features, positions):
    """The cacheable context K/V: context_features [B,T,F] at positions [B,T] -> (k, v) [n, B, Hkv, T, K]
    (head-major, the cache's layout).

    k is k_norm'ed and roped; both are in the parameters' dtype.
    """
    return fused_context_kv(params, cfg, fused_context(params, cfg, context_features), positions)


def fused_context_kv(params, cfg: DrafterConfig, ctx_BTD, positions):
    """`context_kv` from the fused context hidden_norm(fc(features)) [B,T,D]."""
    if positions.shape != ctx_BTD.shape[:2]:
        raise ValueError(f"positions: expected {ctx_BTD.shape[:2]}, got {positions.shape}")
    cos, sin = rope_cos_sin(cfg, positions)
    # a loop, not vmap: XLA would turn the vmapped dot into one GEMM over a transposed copy of all layers' weights
    return jax.lax.map(lambda attn: layer_kv(attn, cfg, ctx_BTD, cos, sin), params["layers"]["attn"])


@functools.partial(jax.jit, static_argnames="cfg")
def draft_block(params, cfg: DrafterConfig, embed_VD, lm_head_DV, ctx_k, ctx_v, ctx_len, bonus_ids, start):
    """The block against a context cache -> [B, b-1, V] float32.

    ctx_k, ctx_v [n, B, Hkv, S_max, K] (from `context_kv`); ctx_len [B]: rows [0, ctx_len) are valid;
    bonus_ids [B]; start [B]: the block sits at positions start..start+b-1 and sees the valid rows and itself.
    """
    n, B, Hkv, S, K = ctx_k.shape
    want = (cfg.num_hidden_layers, B, cfg.num_key_value_heads, S, cfg.head_dim)
    if ctx_k.shape != want or ctx_v.shape != want:
        raise ValueError(f"ctx_k/ctx_v: expected [n, B, Hkv, S_max, K] = {want}, got {ctx_k.shape}, {ctx_v.shape}")
    for name, x in (("ctx_len", ctx_len), ("bonus_ids", bonus_ids), ("start", start)):
        if x.shape != (B,):
            raise ValueError(f"{name}: expected [{B}], got {x.shape}")
    h = _block_embeddings(params, cfg, embed_VD, bonus_ids)
    cos, sin = rope_cos_sin(cfg, start[:, None] + jnp.arange(cfg.block_size))
    visible = jnp.arange(S)[None] < ctx_len[:, None]

    def body(h, xs):
        layer, k_ctx, v_ctx = xs
        attend = lambda q, k, v: _attend(q, k_ctx, v_ctx, k, v, visible)
        return decoder_layer(layer, cfg, h, cos, sin, attend), None

    h, _ = jax.lax.scan(body, h, (params["layers"], ctx_k, ctx_v))
    return block_logits(params, cfg, lm_head_DV, h)


# ---- sharding --------------------------------------------------------------------------------------------
def drafter_partition_specs(cfg: DrafterConfig, model_axis_size: int) -> dict:
    """PartitionSpecs mirroring the parameter tree for a ("data", "model") mesh whose "model" axis has
    `model_axis_size` devices: heads, the MLP intermediate and fc's input split over "model" where they divide,
    replicated otherwise; norms replicated (declared in `params.drafter_table`)."""
    return param_table.partition_specs(param_table.drafter_table(cfg, model_axis_size))


def drafter_cache_partition_spec(cfg: DrafterConfig, model_axis_size: int) -> P:
    """Context K/V cache [n, B, Hkv, S_max, K]: batch over "data", kv heads over "model" as the attention is."""
    return P(None, DATA, MODEL if param_table.drafter_heads_split(cfg, model_axis_size) else None, None, None)
