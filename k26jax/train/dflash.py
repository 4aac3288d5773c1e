"""The DFlash drafter objective: many blocks of one sequence in one forward pass, on the drafter's own layers.

Per sequence, anchors a are sampled among positions whose token and next token are supervised. Anchor a's block
is [x_a, MASK x (b-1)] at positions a..a+b-1 (slot 0 holds the anchor token, the bonus token at inference).
Every drafter layer runs `k26jax.model.drafter`'s layer on all blocks at once; its attention is the DFlash mask:
a block token sees the context K/V (KV injection of the fused target features) of positions strictly before its
anchor, and every token of its own block (bidirectionally), and no other block. Labels are not shifted: slot k
predicts x_{a+k}; slot 0 carries no loss. The cross-entropy of slot k >= 1 is weighted by exp(-(k-1)/gamma) and
the sum is normalised by the weights of the labels present. The target's embedding and lm_head are inputs
(frozen); only the drafter's parameters are differentiated.

`draft_logits` of one block equals `k26jax.model.drafter.draft_logits` on the context before its anchor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from k26jax.config import DrafterConfig, ModelConfig
from k26jax.model import drafter as D
from k26jax.model import params as param_table
from k26jax.train import target as target_train

F32 = jnp.float32


def slot_weights(block_size: int, gamma: float):
    """[b] loss weights: 0 for slot 0 (the anchor itself), exp(-(k-1)/gamma) for slot k >= 1."""
    k = jnp.arange(block_size, dtype=F32)
    return jnp.where(k == 0, 0.0, jnp.exp(-(k - 1) / gamma))


def sample_anchors(key, can_anchor_BT, num_anchors: int):
    """Up to num_anchors distinct positions per row, uniformly among those with can_anchor_BT.

    Returns (anchors [B, A] int32 in ascending order, anchor_ok [B, A]); rows with fewer candidates fill the rest
    with position 0 and anchor_ok False."""
    scores = jnp.where(can_anchor_BT, jax.random.uniform(key, can_anchor_BT.shape), -1.0)
    top, pos = jax.lax.top_k(scores, num_anchors)
    ok = top >= 0
    pos = jnp.where(ok, pos, can_anchor_BT.shape[1])
    order = jnp.argsort(pos, axis=-1)
    pos, ok = jnp.take_along_axis(pos, order, -1), jnp.take_along_axis(ok, order, -1)
    return jnp.where(ok, pos, 0).astype(jnp.int32), ok


def can_anchor(lengths_B, supervised_from_B, T: int):
    """Positions a with x_a and x_{a+1} supervised: supervised_from <= a and a + 1 < length (and a >= 1, so the
    block has context)."""
    t = jnp.arange(T)[None]
    return (t >= jnp.maximum(supervised_from_B[:, None], 1)) & (t + 1 < lengths_B[:, None])


def block_labels(ids_BT, lengths_B, anchors_BA, anchor_ok_BA, block_size: int):
    """(labels [B, A, b] = x_{a+k}, present [B, A, b]: the anchor is real and a + k < length)."""
    pos = anchors_BA[..., None] + jnp.arange(block_size)
    T = ids_BT.shape[1]
    labels = jnp.take_along_axis(ids_BT[:, None, :], jnp.minimum(pos, T - 1), axis=-1)
    return labels, anchor_ok_BA[..., None] & (pos < lengths_B[:, None, None])


def _einsum(subscripts: str, a, b):
    """einsum accumulated in fp32 (operands upcast on the CPU, whose dot has no bf16 x bf16 -> f32 form; exact,
    since a product of two bf16 values is representable in f32)."""
    if jax.default_backend() == "cpu":
        return jnp.einsum(subscripts, a.astype(F32), b.astype(F32))
    return jnp.einsum(subscripts, a, b, preferred_element_type=F32)


def _block_attend(q_BQNK, k_ctx_BMTK, v_ctx_BMTK, k_blk_BMQK, v_blk_BMQK, ctx_visible_BAT, block_size: int):
    """The DFlash mask's attention: block j's queries see context rows with ctx_visible[:, j] and block j alone.
    One softmax over both key sets, fp32 scores (as drafter._attend)."""
    B, Q, N, K = q_BQNK.shape
    M, A, b = k_ctx_BMTK.shape[1], Q // block_size, block_size
    q = q_BQNK.reshape(B, A, b, M, N // M, K)
    kb, vb = (x.reshape(B, M, A, b, K) for x in (k_blk_BMQK, v_blk_BMQK))
    s_ctx = _einsum("zatmgk,zmsk->zmgats", q, k_ctx_BMTK) * K**-0.5
    s_ctx = jnp.where(ctx_visible_BAT[:, None, None, :, None, :], s_ctx, -jnp.inf)
    s_blk = _einsum("zatmgk,zmauk->zmgatu", q, kb) * K**-0.5
    m = jnp.maximum(s_ctx.max(-1, keepdims=True), s_blk.max(-1, keepdims=True))  # finite: the block is seen
    e_ctx, e_blk = jnp.exp(s_ctx - m), jnp.exp(s_blk - m)
    denom = e_ctx.sum(-1, keepdims=True) + e_blk.sum(-1, keepdims=True)
    p_ctx, p_blk = (e_ctx / denom).astype(v_ctx_BMTK.dtype), (e_blk / denom).astype(vb.dtype)
    o = _einsum("zmgats,zmsk->zmgatk", p_ctx, v_ctx_BMTK) + _einsum("zmgatu,zmauk->zmgatk", p_blk, vb)
    return o.astype(q_BQNK.dtype).transpose(0, 3, 4, 1, 2, 5).reshape(B, Q, N, K)


def draft_logits(params, cfg: DrafterConfig, embed_VD, lm_head_DV, features_BTF, ids_BT, anchors_BA):
    """Logits [B, A, b-1, V] f32 of every anchor's block, all in one pass (see the module docstring).

    features_BTF: the target's hidden states at cfg.target_layer_ids, concatenated, for positions 0..T-1."""
    B, T = ids_BT.shape
    A, b = anchors_BA.shape[1], cfg.block_size
    ctx_BTD = D.fused_context(params, cfg, features_BTF)
    block_ids = jnp.full((B, A, b), cfg.mask_token_id, jnp.int32)
    block_ids = block_ids.at[..., 0].set(jnp.take_along_axis(ids_BT, anchors_BA, axis=1))
    h = (embed_VD[block_ids] * cfg.input_embedding_scale).astype(params["fc"].dtype).reshape(B, A * b, -1)
    cos_blk, sin_blk = D.rope_cos_sin(cfg, (anchors_BA[..., None] + jnp.arange(b)).reshape(B, A * b))
    cos_ctx, sin_ctx = D.rope_cos_sin(cfg, jnp.broadcast_to(jnp.arange(T), (B, T)))
    visible = jnp.arange(T)[None, None] < anchors_BA[..., None]

    def body(h, layer):
        k_ctx, v_ctx = D.layer_kv(layer["attn"], cfg, ctx_BTD, cos_ctx, sin_ctx)
        attend = lambda q, k, v: _block_attend(q, k_ctx, v_ctx, k, v, visible, b)
        return D.decoder_layer(layer, cfg, h, cos_blk, sin_blk, attend), None

    h, _ = jax.lax.scan(body, h, params["layers"])
    logits = D.block_logits(params, cfg, lm_head_DV, h.reshape(B * A, b, -1))
    return logits.reshape(B, A, b - 1, -1)


def block_loss(logits_BALV, labels_BAb, present_BAb, gamma: float):
    """(weighted CE over slots 1..b-1 normalised by the weights present, metrics).

    metrics: per-slot top-1 accuracy [b-1] over present labels, and `tau`: the mean over anchors whose whole
    block is present of 1 + the number of leading slots whose argmax equals the label (the chain's accept
    length when the sequence is the target's own greedy continuation)."""
    b = labels_BAb.shape[-1]
    w = slot_weights(b, gamma)[1:] * present_BAb[..., 1:]
    logz = jax.nn.logsumexp(logits_BALV, axis=-1)
    picked = jnp.take_along_axis(logits_BALV, labels_BAb[..., 1:, None], axis=-1)[..., 0]
    loss = jnp.sum(w * (logz - picked)) / jnp.maximum(jnp.sum(w), 1e-9)
    hit = (jnp.argmax(logits_BALV, axis=-1) == labels_BAb[..., 1:]) & present_BAb[..., 1:]
    present = present_BAb[..., 1:].astype(F32)
    acc = jnp.sum(hit, axis=(0, 1)) / jnp.maximum(jnp.sum(present, axis=(0, 1)), 1.0)
    full = jnp.all(present_BAb, axis=-1).astype(F32)
    tau = 1.0 + jnp.sum(jnp.cumprod(hit.astype(F32), axis=-1), axis=-1)
    return loss, {"acc": acc, "tau": jnp.sum(tau * full) / jnp.maximum(jnp.sum(full), 1.0), "blocks": jnp.sum(full)}


def objective(params, cfg: DrafterConfig, embed_VD, lm_head_DV, features_BTF, ids_BT, lengths_B, anchors, gamma):
    """The drafter loss and metrics for given anchors ((anchors [B, A], anchor_ok [B, A]))."""
    anchors_BA, ok_BA = anchors
    logits = draft_logits(params, cfg, embed_VD, lm_head_DV, features_BTF, ids_BT, anchors_BA)
    labels, present = block_labels(ids_BT, lengths_B, anchors_BA, ok_BA, cfg.block_size)
    return block_loss(logits, labels, present, gamma)


# ---- training --------------------------------------------------------------------------------------------
def init_params(cfg: DrafterConfig, seed: int) -> dict:
    """float32 drafter parameters from the model's table (the layout `k26jax.model.drafter` runs)."""
    return target_train.init_from_table(param_table.drafter_table(cfg), seed)


def k26_features(cfg: ModelConfig, layer_ids: tuple[int, ...]) -> Callable:
    """features_fn for a k26jax target: (target training-layout params, ids [B,T]) -> the hidden states of
    `layer_ids` concatenated [B, T, len(layer_ids) * D], as the engine feeds the drafter."""

    def features(tparams, ids_BT):
        _, feats, _ = target_train.forward(
            tparams, cfg, ids_BT, hidden_layer_ids=tuple(layer_ids), remat=False, with_logits=False
        )
        return jnp.concatenate(list(feats), axis=-1)

    return features


def _cast(params, dtype):
    return jax.tree.map(lambda a: a.astype(dtype), params)


def make_train_step(
    cfg: DrafterConfig, opt, features_fn: Callable, *, gamma: float, num_anchors: int, seed: int, dtype=jnp.bfloat16
):
    """jitted (state=(drafter params, opt_state), batch, step, frozen) -> (state, metrics).

    batch: ids [B,T] int, lengths [B] (real tokens), supervised_from [B] (first position an anchor may take, e.g.
    the prompt length). frozen: {"target": the target's params for features_fn, "embed": [V,D], "lm_head": [D,V]}.
    Anchors are drawn afresh each step from (seed, step)."""

    def loss_fn(dparams, frozen, feats, batch, anchors):
        p = _cast(dparams, dtype)
        return objective(
            p, cfg, frozen["embed"], frozen["lm_head"], feats, batch["ids"], batch["lengths"], anchors, gamma
        )

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batch, step, frozen):
        dparams, opt_state = state
        feats = jax.lax.stop_gradient(features_fn(frozen["target"], batch["ids"]))
        ok = can_anchor(batch["lengths"], batch["supervised_from"], batch["ids"].shape[1])
        anchors = sample_anchors(jax.random.fold_in(jax.random.key(seed), step), ok, num_anchors)
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(dparams, frozen, feats, batch, anchors)
        updates, opt_state = opt.update(grads, opt_state, dparams)
        dparams = optax.apply_updates(dparams, updates)
        return (dparams, opt_state), {"loss": loss, "tau": metrics["tau"], "grad_norm": optax.tree.norm(grads)}

    return train_step


def make_eval_step(cfg: DrafterConfig, features_fn: Callable, *, gamma: float, num_anchors: int, dtype=jnp.bfloat16):
    """jitted (drafter params, batch, key, frozen) -> (loss, metrics) on anchors drawn from `key`."""

    @jax.jit
    def eval_step(dparams, batch, key, frozen):
        feats = features_fn(frozen["target"], batch["ids"])
        ok = can_anchor(batch["lengths"], batch["supervised_from"], batch["ids"].shape[1])
        anchors = sample_anchors(key, ok, num_anchors)
        p = _cast(dparams, dtype)
        return objective(
            p, cfg, frozen["embed"], frozen["lm_head"], feats, batch["ids"], batch["lengths"], anchors, gamma
        )

    return eval_step


def evaluate(eval_step, dparams, frozen, batches, seed: int = 0) -> dict:
    """Held-out loss, tau and per-slot accuracy over `batches` (fixed anchors from `seed`), weighted by the
    number of whole blocks each batch has."""
    sums, weight = {"loss": 0.0, "tau": 0.0, "acc": 0.0}, 0.0
    for i, batch in enumerate(batches):
        loss, m = eval_step(dparams, batch, jax.random.fold_in(jax.random.key(seed), i), frozen)
        w = float(m["blocks"])
        sums["loss"] += w * float(loss)
        sums["tau"] += w * float(m["tau"])
        sums["acc"] = sums["acc"] + w * np.asarray(m["acc"])
        weight += w
    out = {k: v / max(weight, 1.0) for k, v in sums.items()}
    out["acc"] = [round(float(a), 4) for a in out["acc"]]
    return out
