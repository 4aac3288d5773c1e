"""The K2 / K2.6 target model in Flax NNX, with parameters stacked per layer kind and run with lax.scan.

Parameter tree (= `nnx.state(model).to_pure_dict()`; [in, out] matmul layout; n = layers of that kind):
  embed [V, D], final_norm [D], lm_head [D, V]
  dense | moe: input_norm [n, D], post_attn_norm [n, D],
    attn: q_a [n, D, Rq], q_a_norm [n, Rq], q_b [n, Rq, H, Dn+Dr]   (q_lora_rank null: q [n, D, H, Dn+Dr])
          kv_a [n, D, R+Dr], kv_a_norm [n, R], w_uk [n, H, Dn, R], w_uv [n, H, Dv, R], o [n, H, Dv, D]
    mlp (dense): gate_up [n, D, 2, I], down [n, I, D]
    mlp (moe):   router_kernel [n, D, E], router_bias [n, E] f32, shared {gate_up [n, D, 2, Is], down [n, Is, D]},
                 w13_packed [n, E, D/8, 2, Im] int32, w13_scale [n, E, D/32, 2, Im] bf16,
                 w2_packed [n, E, Im/8, D] int32, w2_scale [n, E, Im/32, D] bf16
Layers run in `cfg.layer_kinds` order as segments of consecutive same-kind layers (one scan per segment).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from k26jax import ops
from k26jax.config import ModelConfig
from k26jax.model import layers as L

PACK = 8  # INT4 values per int32 word


def _param(rngs: nnx.Rngs, shape, dtype, std: float | None):
    """std None: ones (norm weights); else normal(0, std)."""
    if std is None:
        return nnx.Param(jnp.ones(shape, dtype))
    return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))


def _const(shape, dtype, value: float):
    return nnx.Param(jnp.full(shape, value, dtype))


class MLA(nnx.Module):
    def __init__(self, cfg: ModelConfig, n: int, dtype, rngs: nnx.Rngs):
        D, H, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
        Dq, std = cfg.qk_head_dim, D**-0.5
        if cfg.q_lora_rank is None:
            self.q = _param(rngs, (n, D, H, Dq), dtype, std)
        else:
            self.q_a = _param(rngs, (n, D, cfg.q_lora_rank), dtype, std)
            self.q_a_norm = _param(rngs, (n, cfg.q_lora_rank), dtype, None)
            self.q_b = _param(rngs, (n, cfg.q_lora_rank, H, Dq), dtype, cfg.q_lora_rank**-0.5)
        self.kv_a = _param(rngs, (n, D, R + cfg.qk_rope_head_dim), dtype, std)
        self.kv_a_norm = _param(rngs, (n, R), dtype, None)
        self.w_uk = _param(rngs, (n, H, cfg.qk_nope_head_dim, R), dtype, R**-0.5)
        self.w_uv = _param(rngs, (n, H, cfg.v_head_dim, R), dtype, R**-0.5)
        self.o = _param(rngs, (n, H, cfg.v_head_dim, D), dtype, (H * cfg.v_head_dim) ** -0.5)


class MLP(nnx.Module):
    def __init__(self, D: int, I: int, n: int, dtype, rngs: nnx.Rngs):
        self.gate_up = _param(rngs, (n, D, 2, I), dtype, D**-0.5)
        self.down = _param(rngs, (n, I, D), dtype, I**-0.5)


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, n: int, dtype, rngs: nnx.Rngs):
        D, E, Im = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        g = cfg.quant.group_size if cfg.quant else 32
        self.router_kernel = _param(rngs, (n, D, E), dtype, D**-0.5)
        self.router_bias = _param(rngs, (n, E), jnp.float32, 0.01)
        if cfg.n_shared_experts:
            self.shared = MLP(D, Im * cfg.n_shared_experts, n, dtype, rngs)
        bits = lambda shape: nnx.Param(jax.random.bits(rngs.params(), shape, jnp.uint32).view(jnp.int32))
        # Uniform random INT4 values have std ~4.6: scales 1/(4.6 sqrt(fan_in)) keep activations O(1).
        self.w13_packed = bits((n, E, D // PACK, 2, Im))
        self.w13_scale = _const((n, E, D // g, 2, Im), jnp.bfloat16, 1 / (4.6 * D**0.5))
        self.w2_packed = bits((n, E, Im // PACK, D))
        self.w2_scale = _const((n, E, Im // g, D), jnp.bfloat16, 1 / (4.6 * Im**0.5))


class DecoderStack(nnx.Module):
    """n decoder layers of one kind ("dense" or "moe"), parameters stacked on a leading axis."""

    def __init__(self, cfg: ModelConfig, kind: str, n: int, dtype, rngs: nnx.Rngs):
        self.input_norm = _param(rngs, (n, cfg.hidden_size), dtype, None)
        self.post_attn_norm = _param(rngs, (n, cfg.hidden_size), dtype, None)
        self.attn = MLA(cfg, n, dtype, rngs)
        self.mlp = (
            MLP(cfg.hidden_size, cfg.intermediate_size, n, dtype, rngs) if kind == "dense" else MoE(cfg, n, dtype, rngs)
        )


class K2Model(nnx.Module):
    """Random-initialised K2 target (checkpoints overwrite the state; see k26jax.checkpoint / k26jax.load)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed = _param(rngs, (V, D), dtype, 1.0)
        self.final_norm = _param(rngs, (D,), dtype, None)
        self.lm_head = _param(rngs, (D, V), dtype, D**-0.5)
        if cfg.num_dense_layers:
            self.dense = DecoderStack(cfg, "dense", cfg.num_dense_layers, dtype, rngs)
        if cfg.num_moe_layers:
            self.moe = DecoderStack(cfg, "moe", cfg.num_moe_layers, dtype, rngs)


def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """The parameter tree as ShapeDtypeStructs, without allocating it."""
    model = nnx.eval_shape(lambda: K2Model(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(model))


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.bfloat16) -> dict:
    return nnx.to_pure_dict(nnx.state(K2Model(cfg, dtype=dtype, rngs=nnx.Rngs(seed))))


# ---- forward ---------------------------------------------------------------------------------------------
def segments(cfg: ModelConfig):
    """[(kind, first index in that kind's stack, count, first global layer)] in layer order."""
    out, seen, layer = [], {"dense": 0, "moe": 0}, 0
    for kind, run in itertools.groupby(cfg.layer_kinds):
        n = len(list(run))
        out.append((kind, seen[kind], n, layer))
        seen[kind] += n
        layer += n
    return out


EXPERT_KEYS = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")


def _moe_ffn(mlp, experts, index, x_BTD, cfg: ModelConfig, impls: ops.Impls):
    """MoE FFN of MoE layer `index`; `experts` holds the whole stacks of the routed-expert weights."""
    B, T, D = x_BTD.shape
    x_ND = x_BTD.reshape(B * T, D)
    topk_ids, topk_weights = L.route(mlp["router_kernel"], mlp["router_bias"], x_ND, cfg)
    y = ops.moe_gemm(x_ND, topk_ids, topk_weights, *(experts[k] for k in EXPERT_KEYS), layer=index, impls=impls)
    if "shared" in mlp:
        y = y + L.swiglu_mlp(mlp["shared"], x_ND[None])[0]
    return y.reshape(B, T, D)


def _split_experts(stack):
    """(stack without the routed-expert weights, those weights) -- the experts are not scanned over."""
    if "w13_packed" not in stack["mlp"]:
        return stack, None
    mlp = {k: v for k, v in stack["mlp"].items() if k not in EXPERT_KEYS}
    return {**stack, "mlp": mlp}, {k: stack["mlp"][k] for k in EXPERT_KEYS}


def run_layers(params, cfg: ModelConfig, x_BTD, attend, impls: ops.Impls, hidden_layer_ids=()):
    """Run every decoder layer. `attend(attn_params, x_normed, layer) -> (attn_out, latent_rows)`, layer the
    (traced) index of the decoder layer, so a cache can be read in place.

    Returns (h [B,T,D], latent rows [layers,B,T,R+Dr], hidden states [len(ids),B,T,D] of the requested layers).
    """
    wanted = jnp.asarray(hidden_layer_ids, jnp.int32).reshape(-1)
    feats = jnp.zeros((wanted.shape[0],) + x_BTD.shape, x_BTD.dtype)
    all_rows = []
    for kind, first, count, layer0 in segments(cfg):
        scanned, experts = _split_experts(params[kind])
        xs = {
            "p": jax.tree.map(lambda a: a[first : first + count], scanned),
            "layer": layer0 + jnp.arange(count, dtype=jnp.int32),
            "index": first + jnp.arange(count, dtype=jnp.int32),
        }

        def body(carry, xs, kind=kind, experts=experts):
            h, feats = carry
            p = xs["p"]
            a, rows = attend(p["attn"], L.rms_norm(h, p["input_norm"], cfg.rms_norm_eps), xs["layer"])
            h = h + a
            x = L.rms_norm(h, p["post_attn_norm"], cfg.rms_norm_eps)
            h = h + (
                L.swiglu_mlp(p["mlp"], x)
                if kind == "dense"
                else _moe_ffn(p["mlp"], experts, xs["index"], x, cfg, impls)
            )
            feats = jnp.where((wanted == xs["layer"])[:, None, None, None], h[None], feats)
            return (h, feats), rows

        if count == 1:  # static index: a one-layer scan would copy the layer's weights out with a dynamic slice
            (x_BTD, feats), rows = body((x_BTD, feats), jax.tree.map(lambda a: a[0], xs))
            rows = rows[None]
        else:
            (x_BTD, feats), rows = jax.lax.scan(body, (x_BTD, feats), xs)
        all_rows.append(rows)
    return x_BTD, jnp.concatenate(all_rows, axis=0), feats


def embed_tokens(params, ids_BT):
    return jnp.take(params["embed"], ids_BT, axis=0)


def lm_logits(params, cfg: ModelConfig, h_BTD):
    h = L.rms_norm(h_BTD, params["final_norm"], cfg.rms_norm_eps)
    return L.mm("btd,dv->btv", h, params["lm_head"], out_dtype=jnp.float32)


def forward_prefill(params, cfg: ModelConfig, ids_BT, lengths_B, impls: ops.Impls, hidden_layer_ids=()):
    """Causal forward over right-padded prompts (rows >= length are padding), no cache read.

    Returns (logits f32 [B,T,V], latent rows [layers,B,T,R+Dr] to store at cache positions 0..T-1,
    hidden states [n_ids,B,T,D]).
    """
    T = ids_BT.shape[1]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), ids_BT.shape)
    valid = positions < lengths_B[:, None]
    rope = L.rope_inv_freq(cfg)

    def attend(attn, x, _):
        return L.mla_naive(attn, x, positions, valid, cfg, rope)

    h, rows, feats = run_layers(params, cfg, embed_tokens(params, ids_BT), attend, impls, hidden_layer_ids)
    return lm_logits(params, cfg, h), rows, feats


def forward_tail(
    params,
    cfg: ModelConfig,
    ids_BT,
    positions_BT,
    cache,
    prefix_len_B,
    visibility_BTT,
    impls: ops.Impls,
    hidden_layer_ids=(),
):
    """Absorbed-MLA forward of T new tokens per sequence (decode T=1, tree verify T=B+1).

    Row t attends to cache rows [0, prefix_len) and to the tail rows u with visibility[t, u].
    cache [layers, B, S_max, R+Dr] is only read. Returns (logits f32 [B,T,V], the tail's latent rows
    [layers,B,T,R+Dr], hidden states [n_ids,B,T,D]).
    """
    rope = L.rope_inv_freq(cfg)

    def attend(attn, x, layer):
        q_lat, q_pe = L.mla_absorbed_queries(attn, x, positions_BT, cfg, rope)
        rows = L.mla_latent_rows(attn, x, positions_BT, cfg, rope)
        o_lat = ops.mla_attention(
            q_lat, q_pe, cache, prefix_len_B, rows, visibility_BTT, scale=cfg.softmax_scale, layer=layer, impls=impls
        )
        return L.mla_absorbed_output(attn, o_lat), rows

    h, rows, feats = run_layers(params, cfg, embed_tokens(params, ids_BT), attend, impls, hidden_layer_ids)
    return lm_logits(params, cfg, h), rows, feats
