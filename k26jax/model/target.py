"""The K2 / K2.6 target model in Flax NNX, with parameters stacked per layer kind and run with lax.scan.

The parameter tree (= `K2Model(...).params()`) is declared in k26jax/model/params.py (`target_table`): [in, out]
matmul layout, leaves of the dense and MoE layers stacked on a leading layer axis, routed experts INT4.
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
from k26jax.model import params as param_table


class K2Model(nnx.Module):
    """The K2 target: its Params are `params.target_table(cfg)` (random init; checkpoints overwrite the state, see
    `from_params`), its methods run the forward: `prefill`, `verify` and `decode` (verify of one token).

    The methods and the module-level functions below share one implementation: a method passes the module's pure
    parameter tree to `forward_prefill` / `forward_tail`. A jitted step takes the pure tree as its argument and
    wraps it with `from_params` inside (k26jax/engine.py)."""

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.cfg = cfg
        param_table.build(self, param_table.target_table(cfg), dtype, rngs)

    @classmethod
    def from_params(cls, cfg: ModelConfig, tree: dict) -> K2Model:
        """A module holding `tree` (e.g. from k26jax.hf.read_target or checkpoint.restore), without a random init."""
        model = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
        param_table.load_into(model, tree)
        return model

    def params(self) -> dict:
        return param_table.pure_params(self)

    def prefill(self, ids_BT, lengths_B, impls: ops.Impls, hidden_layer_ids=(), last_only: bool = False):
        """Causal forward over right-padded prompts: see `forward_prefill`."""
        return forward_prefill(self.params(), self.cfg, ids_BT, lengths_B, impls, hidden_layer_ids, last_only)

    def verify(
        self,
        ids_BT,
        positions_BT,
        cache_rows,
        prefix_len_B,
        visibility_BTT,
        impls: ops.Impls,
        hidden_layer_ids=(),
        active_B=None,
    ):
        """T new tokens per sequence against the latent cache (a tree tail, a chain, or one token): `forward_tail`."""
        return forward_tail(
            self.params(),
            self.cfg,
            ids_BT,
            positions_BT,
            cache_rows,
            prefix_len_B,
            visibility_BTT,
            impls,
            hidden_layer_ids,
            active_B,
        )

    def decode(self, ids_B1, positions_B1, cache_rows, prefix_len_B, impls: ops.Impls, hidden_layer_ids=()):
        """One token per sequence: `verify` with T = 1."""
        visibility = jnp.ones((ids_B1.shape[0], 1, 1), bool)
        return self.verify(ids_B1, positions_B1, cache_rows, prefix_len_B, visibility, impls, hidden_layer_ids)


def abstract_params(cfg: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """The parameter tree as ShapeDtypeStructs, without allocating it."""
    return nnx.eval_shape(lambda: K2Model(cfg, dtype=dtype, rngs=nnx.Rngs(0))).params()


def init_params(cfg: ModelConfig, seed: int = 0, dtype=jnp.bfloat16) -> dict:
    return K2Model(cfg, dtype=dtype, rngs=nnx.Rngs(seed)).params()


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


def _moe_ffn(mlp, experts, index, x_BTD, cfg: ModelConfig, impls: ops.Impls, active_B=None):
    """MoE FFN of MoE layer `index`; `experts` holds the whole stacks of the routed-expert weights. The tokens of
    sequences not in active_B (bool [B]: a finished slot's, whose outputs are not used) go to no expert (id -1,
    which every expert shard skips), so they add no expert reads."""
    B, T, D = x_BTD.shape
    x_ND = x_BTD.reshape(B * T, D)
    with jax.named_scope("router"):
        topk_ids, topk_weights = L.route(mlp["router_kernel"], mlp["router_bias"], x_ND, cfg)
        if active_B is not None:
            topk_ids = jnp.where(jnp.repeat(active_B, T)[:, None], topk_ids, -1)
    y = ops.moe_gemm(x_ND, topk_ids, topk_weights, *(experts[k] for k in EXPERT_KEYS), layer=index, impls=impls)
    if "shared" in mlp:
        with jax.named_scope("shared_expert"):
            y = y + L.swiglu_mlp(mlp["shared"], x_ND[None])[0]
    return y.reshape(B, T, D)


def _split_experts(stack):
    """(stack without the routed-expert weights, those weights) -- the experts are not scanned over."""
    if "w13_packed" not in stack["mlp"]:
        return stack, None
    mlp = {k: v for k, v in stack["mlp"].items() if k not in EXPERT_KEYS}
    return {**stack, "mlp": mlp}, {k: stack["mlp"][k] for k in EXPERT_KEYS}


def run_layers(params, cfg: ModelConfig, x_BTD, attend, impls: ops.Impls, hidden_layer_ids=(), active_B=None):
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

        def body(carry, xs, kind=kind, experts=experts, scanned=scanned):
            h, feats = carry
            p = jax.tree.map(  # weight matrices: the whole stack too, for a kernel that reads its layer in place
                lambda a, sliced: sliced if a.ndim < 3 else ops.LayerWeight(a, xs["index"], impls, sliced),
                scanned,
                xs["p"],
            )
            with jax.named_scope("norm"):
                x = L.rms_norm(h, p["input_norm"], cfg.rms_norm_eps)
            a, rows = attend(p["attn"], x, xs["layer"])
            h = h + a
            with jax.named_scope("norm"):
                x = L.rms_norm(h, p["post_attn_norm"], cfg.rms_norm_eps)
            if kind == "dense":
                with jax.named_scope("dense_mlp"):
                    h = h + L.swiglu_mlp(p["mlp"], x)
            else:
                h = h + _moe_ffn(p["mlp"], experts, xs["index"], x, cfg, impls, active_B)
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
    with jax.named_scope("lm_head"):
        h = L.rms_norm(h_BTD, params["final_norm"], cfg.rms_norm_eps)
        return L.mm("btd,dv->btv", h, params["lm_head"], out_dtype=jnp.float32)


def forward_prefill(
    params, cfg: ModelConfig, ids_BT, lengths_B, impls: ops.Impls, hidden_layer_ids=(), last_only: bool = False
):
    """Causal forward over right-padded prompts (rows >= length are padding), no cache read.

    Returns (logits f32 [B,T,V], or [B,1,V] at each prompt's last row when last_only (what decoding needs: the
    head's [B,T,V] would be gigabytes at K2.6's vocabulary), latent rows [layers,B,T,R+Dr] to store at cache
    positions 0..T-1, hidden states [n_ids,B,T,D]).
    """
    T = ids_BT.shape[1]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), ids_BT.shape)
    valid = positions < lengths_B[:, None]
    rope = L.rope_inv_freq(cfg)

    def attend(attn, x, _):
        return L.mla_naive(attn, x, positions, valid, cfg, rope)

    h, rows, feats = run_layers(params, cfg, embed_tokens(params, ids_BT), attend, impls, hidden_layer_ids)
    if last_only:
        h = jnp.take_along_axis(h, (lengths_B - 1)[:, None, None], axis=1)
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
    active_B=None,
):
    """Absorbed-MLA forward of T new tokens per sequence (decode T=1, tree verify T=B+1).

    Row t attends to cache rows [0, prefix_len) and to the tail rows u with visibility[t, u].
    cache [layers, B, S_max, R+Dr] is only read. active_B (bool [B], optional): the sequences whose outputs are
    used; the others read no cache rows and no experts, so a batch with finished slots costs about what its live
    ones do. Returns (logits f32 [B,T,V], the tail's latent rows [layers,B,T,R+Dr], hidden states [n_ids,B,T,D]).
    """
    rope = L.rope_inv_freq(cfg)
    if active_B is not None:
        prefix_len_B = jnp.where(active_B, prefix_len_B, 0)

    def attend(attn, x, layer):
        with jax.named_scope("mla_in"):
            q_lat, q_pe = L.mla_absorbed_queries(attn, x, positions_BT, cfg, rope)
            rows = L.mla_latent_rows(attn, x, positions_BT, cfg, rope)
        o_lat = ops.mla_attention(
            q_lat, q_pe, cache, prefix_len_B, rows, visibility_BTT, scale=cfg.softmax_scale, layer=layer, impls=impls
        )
        with jax.named_scope("mla_out"):
            return L.mla_absorbed_output(attn, o_lat), rows

    h, rows, feats = run_layers(params, cfg, embed_tokens(params, ids_BT), attend, impls, hidden_layer_ids, active_B)
    return lm_logits(params, cfg, h), rows, feats
