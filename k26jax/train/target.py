"""The target's training forward and next-token loss, on the model's own layers (k26jax.model.layers).

Training parameters are the model's tree (k26jax/model/target.py) with the routed experts in float instead of
INT4: `moe.mlp.w13` [n, E, D, 2, I] and `moe.mlp.w2` [n, E, I, D] replace the four packed leaves. Master weights
are float32; the forward casts them to the compute dtype (router bias and router logits stay float32).

The forward is the inference math: rms_norm, naive MLA with a causal mask, YaRN rope, sigmoid noaux_tc routing
(`layers.route`), SwiGLU, the shared expert. The routed experts run densely: every token through all E experts,
combined by its top-k weights (zero elsewhere), which at 16 experts costs less than a gather. Expert weights are
used as given (float), or fake-quantized to INT4 (quantization-aware steps), or dequantized from the packed leaves
(`from_inference`), so a quantized model is evaluated by the same code the inference model mirrors.

The router bias is not trained by gradients (it only selects); `bias_update` moves it by the sign of each
expert's load error, DeepSeek-V3's auxiliary-loss-free balancing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from k26jax import quant
from k26jax.config import ModelConfig
from k26jax.model import layers as L
from k26jax.model import params as param_table
from k26jax.model import target as model_target

F32 = jnp.float32
FLOAT_EXPERTS = ("w13", "w2")


# ---- parameters ------------------------------------------------------------------------------------------
def init_from_table(table: dict, seed: int, skip: tuple[str, ...] = ()) -> dict:
    """float32 parameters drawn with numpy from a k26jax.model.params table (its shapes, "normal" stds, "ones",
    "const"), leaf by leaf in table order; leaves named in `skip` are left out. Fast on a CPU (the model's own init
    compiles one random program per shape)."""
    rng, tree = np.random.default_rng(seed), {}
    for path, p, stack in param_table.walk(table):
        if path[-1] in skip:
            continue
        shape = param_table.full_shape(p, None if stack is None else len(stack.hf_layers))
        if p.init == "normal":
            value = p.value * rng.standard_normal(shape, np.float32)
        elif p.init in ("ones", "const"):
            value = np.full(shape, 1.0 if p.init == "ones" else p.value, np.float32)
        else:
            raise ValueError(f"{'/'.join(path)}: init {p.init!r} has no float form")
        parent = tree
        for key in path[:-1]:
            parent = parent.setdefault(key, {})
        parent[path[-1]] = jnp.asarray(value)
    return tree


def init_params(cfg: ModelConfig, seed: int) -> dict:
    """float32 training parameters: the model's table (shapes and stds), float routed experts (std 1/sqrt(fan_in)),
    a zero router bias."""
    params = init_from_table(param_table.target_table(cfg), seed, skip=model_target.EXPERT_KEYS)
    if "moe" not in params:
        return params
    n, E, D, Im = cfg.num_moe_layers, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    rng = np.random.default_rng([seed, 1])
    mlp = params["moe"]["mlp"]
    mlp["w13"] = jnp.asarray(D**-0.5 * rng.standard_normal((n, E, D, 2, Im), np.float32))
    mlp["w2"] = jnp.asarray(Im**-0.5 * rng.standard_normal((n, E, Im, D), np.float32))
    mlp["router_bias"] = jnp.zeros((n, E), F32)
    return params


def to_inference(params: dict, dtype=jnp.bfloat16) -> dict:
    """The model's parameter tree: experts quantized to INT4 (packed + bf16 scales), float leaves in `dtype`,
    the router bias float32."""
    out = cast(params, dtype)
    if "moe" in params:
        mlp = dict(out["moe"]["mlp"])
        mlp.update(quant.quantize_experts(params["moe"]["mlp"]["w13"], params["moe"]["mlp"]["w2"]))
        for key in FLOAT_EXPERTS:
            del mlp[key]
        out["moe"] = dict(out["moe"], mlp=mlp)
    return out


def from_inference(params: dict) -> dict:
    """Training layout from the model's tree: float experts = bf16(q * scale), exactly what inference computes."""
    out = jax.tree.map(lambda a: a, params)
    if "moe" in params:
        mlp = dict(out["moe"]["mlp"])
        mlp["w13"], mlp["w2"] = quant.dequantize_experts({k: mlp.pop(k) for k in model_target.EXPERT_KEYS})
        out["moe"] = dict(out["moe"], mlp=mlp)
    return out


def cast(params: dict, dtype) -> dict:
    """Float leaves to `dtype`, except the router bias (float32, as the model keeps it)."""

    def one(path, a):
        if path[-1].key == "router_bias" or not jnp.issubdtype(a.dtype, jnp.floating):
            return a
        return a.astype(dtype)

    return jax.tree_util.tree_map_with_path(one, params)


# ---- forward ---------------------------------------------------------------------------------------------
def routed_experts(w13_EDGI, w2_EID, topk_ids, topk_weights, x_ND):
    """sum_k weight_k * down_e(silu(gate_e x) * up_e x), all experts computed, non-selected weighted 0."""
    E = w13_EDGI.shape[0]
    coef_NE = jnp.einsum("nk,nke->ne", topk_weights, jax.nn.one_hot(topk_ids, E, dtype=F32))
    gu = L.mm("bnd,edgi->bnegi", x_ND[None], w13_EDGI)[0]
    h = jax.nn.silu(gu[..., 0, :]) * gu[..., 1, :]
    out = L.mm("bnei,eid->bned", h[None], w2_EID, out_dtype=F32)[0]
    return jnp.einsum("ne,ned->nd", coef_NE, out).astype(x_ND.dtype)


def _moe_ffn(mlp, x_BTD, cfg: ModelConfig, fake_quant: bool):
    B, T, D = x_BTD.shape
    x_ND = x_BTD.reshape(B * T, D)
    topk_ids, topk_weights = L.route(mlp["router_kernel"], mlp["router_bias"], x_ND, cfg)
    w13, w2 = mlp["w13"], mlp["w2"]
    if fake_quant:
        w13, w2 = quant.fake_quant(w13, 1), quant.fake_quant(w2, 1)
    y = routed_experts(w13, w2, topk_ids, topk_weights, x_ND)
    if "shared" in mlp:
        y = y + L.swiglu_mlp(mlp["shared"], x_ND[None])[0]
    load_E = jnp.sum(jax.nn.one_hot(topk_ids, cfg.n_routed_experts, dtype=F32), axis=(0, 1))
    return y.reshape(B, T, D), load_E


def forward(
    params,
    cfg: ModelConfig,
    ids_BT,
    *,
    hidden_layer_ids: tuple[int, ...] = (),
    dtype=jnp.bfloat16,
    fake_quant: bool = False,
    remat: bool = True,
    with_logits: bool = True,
):
    """Causal forward of full rows. Returns (logits f32 [B,T,V] (None unless with_logits), hidden states
    [len(ids),B,T,D] of the requested layers (each one's output, HF's hidden_states[id + 1]), expert loads
    [n_moe, E] (tokens routed to each expert, summed over the batch))."""
    if any(not 0 <= i < cfg.num_hidden_layers for i in hidden_layer_ids):
        raise ValueError(f"hidden_layer_ids {hidden_layer_ids}: the model has {cfg.num_hidden_layers} layers")
    p = cast(params, dtype)
    T = ids_BT.shape[1]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), ids_BT.shape)
    valid = jnp.ones(ids_BT.shape, bool)
    rope = L.rope_inv_freq(cfg)
    collect = bool(hidden_layer_ids)

    def layer(h, lp, kind):
        x = L.rms_norm(h, lp["input_norm"], cfg.rms_norm_eps)
        h = h + L.mla_naive(lp["attn"], x, positions, valid, cfg, rope)[0]
        x = L.rms_norm(h, lp["post_attn_norm"], cfg.rms_norm_eps)
        if kind == "dense":
            return h + L.swiglu_mlp(lp["mlp"], x), jnp.zeros((cfg.n_routed_experts,), F32)
        y, load = _moe_ffn(lp["mlp"], x, cfg, fake_quant)
        return h + y, load

    h = model_target.embed_tokens(p, ids_BT)
    outs, loads = [], []
    for kind, first, count, _ in model_target.segments(cfg):
        step = functools.partial(layer, kind=kind)
        step = jax.checkpoint(step) if remat else step

        def body(h, lp, step=step):
            h, load = step(h, lp)
            return h, (h if collect else None, load)

        stack = jax.tree.map(lambda a: a[first : first + count], p[kind])
        h, (hs, load) = jax.lax.scan(body, h, stack)
        if collect:
            outs.append(hs)
        if kind == "moe":
            loads.append(load)
    feats = jnp.concatenate(outs)[jnp.asarray(hidden_layer_ids)] if collect else None
    loads = jnp.concatenate(loads) if loads else jnp.zeros((0, cfg.n_routed_experts), F32)
    return (model_target.lm_logits(p, cfg, h) if with_logits else None), feats, loads


def token_losses(logits_BTV, ids_BT):
    """Next-token cross-entropy [B, T-1] of positions 0..T-2 (fp32)."""
    logz = jax.nn.logsumexp(logits_BTV[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logits_BTV[:, :-1], ids_BT[:, 1:, None], axis=-1)[..., 0]
    return logz - picked


def lm_loss(params, cfg: ModelConfig, ids_BT, mask_BT, **forward_kw):
    """Mean next-token loss over targets t >= 1 with mask_BT[:, t] (and the expert loads [n_moe, E]).

    mask_BT marks real tokens; position t's target counts when tokens t-1 and t are both real."""
    logits, _, loads = forward(params, cfg, ids_BT, **forward_kw)
    m = (mask_BT[:, 1:] & mask_BT[:, :-1]).astype(F32)
    return jnp.sum(token_losses(logits, ids_BT) * m) / jnp.maximum(jnp.sum(m), 1.0), loads


def bias_update(bias_nE, load_nE, rate: float):
    """DeepSeek-V3's auxiliary-loss-free balancing: each expert's bias rises by `rate` when it got fewer tokens
    than the mean load of its layer, falls by `rate` when it got more, stays when exactly balanced."""
    mean = jnp.mean(load_nE, axis=-1, keepdims=True)
    return bias_nE + rate * jnp.sign(mean - load_nE)


# ---- training --------------------------------------------------------------------------------------------
def decay_mask(params: dict, spared_rows: tuple[int, ...] = ()) -> dict:
    """Weight-decay mask: 1 for matrices, 0 for norms and the router bias; the embedding's `spared_rows`
    (the reserved MASK id, which the target never sees) get 0 so their rows keep their initial scale."""

    def one(path, a):
        key = path[-1].key
        if key.endswith("norm") or key == "router_bias":
            return jnp.zeros((), F32)
        if key == "embed" and spared_rows:
            return jnp.ones((a.shape[0], 1), F32).at[jnp.asarray(spared_rows)].set(0.0)
        return jnp.ones((), F32)

    return jax.tree_util.tree_map_with_path(one, params)


def trainable_mask(params: dict) -> dict:
    """1 for every leaf the optimizer moves, 0 for the router bias (moved by `bias_update` instead)."""
    return jax.tree_util.tree_map_with_path(lambda p, a: jnp.asarray(float(p[-1].key != "router_bias"), F32), params)


def make_train_step(cfg: ModelConfig, opt, *, bias_rate: float, dtype=jnp.bfloat16, fake_quant: bool = False):
    """jitted (state=(params, opt_state), batch={"ids" [B,T], "mask" [B,T]}, step) -> (state, metrics): one AdamW
    step on the next-token loss, then the router-bias balancing update from this batch's expert loads."""

    def loss_fn(params, ids, mask):
        return lm_loss(params, cfg, ids, mask, dtype=dtype, fake_quant=fake_quant)

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch, step):
        params, opt_state = state
        (loss, loads), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch["ids"], batch["mask"])
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        if "moe" in params:
            mlp = params["moe"]["mlp"]
            params["moe"]["mlp"] = dict(mlp, router_bias=bias_update(mlp["router_bias"], loads, bias_rate))
            metrics["max_load"] = jnp.max(loads / jnp.mean(loads, axis=-1, keepdims=True))
        return (params, opt_state), metrics

    return train_step


@functools.partial(jax.jit, static_argnames=("cfg", "fake_quant"))
def _row_loss_sums(params, ids_BT, cfg: ModelConfig, fake_quant: bool = False):
    logits, _, _ = forward(params, cfg, ids_BT, fake_quant=fake_quant, remat=False)
    return jnp.sum(token_losses(logits, ids_BT), axis=-1)


def eval_loss(params, cfg: ModelConfig, windows_NT, batch_size: int, *, fake_quant: bool = False) -> float:
    """Mean next-token loss (nats) over every window's positions 1..T-1, in batches of batch_size rows (the last
    one padded with copies of its first row, which are not counted)."""
    total, n = 0.0, windows_NT.shape[0]
    for start in range(0, n, batch_size):
        rows = np.asarray(windows_NT[start : start + batch_size], np.int32)
        real = rows.shape[0]
        ids = np.concatenate([rows, np.repeat(rows[:1], batch_size - real, 0)])
        total += float(jnp.sum(_row_loss_sums(params, jnp.asarray(ids), cfg, fake_quant)[:real]))
    return total / (n * (windows_NT.shape[1] - 1))
