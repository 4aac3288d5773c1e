"""Prefill and the speculative step: DDTree, chain DFlash and plain AR through one machinery.

One step is one jitted XLA program with donated state and no host round trip:
  draft -> top-K -> tree_build -> target verify over the tree -> per-node choice -> tree_accept -> commit.
AR is the degenerate tree {root}; chain DFlash is top-1 per depth (K = 1, B = L).

The step holds the parameters as plain trees (donation and sharding see arrays) and wraps them in the NNX modules
(`K2Model`, `DFlashDrafter`, `from_params`) at its boundary to run their forward methods.
`Decoder` is the one place that compiles it (jit, donation, XLA options); every caller goes through it. What a
step drafts and how it accepts are two small protocols (`DFlashDraft`, `TreeAccept` by default), so tests and
benchmarks swap them in through the Decoder instead of patching the engine.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import struct

from k26jax import cache as kc
from k26jax import ops
from k26jax.config import ModelConfig
from k26jax.model import drafter as drafter_lib
from k26jax.model import target

METHODS = ("ddtree", "chain", "ar")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static decoding settings (hashable: part of the compiled step's identity)."""

    method: str = "ddtree"
    budget: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    eos_ids: tuple[int, ...] = ()
    block_size: int = 8

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: use one of {METHODS}")
        if self.budget < 1:
            raise ValueError(f"budget={self.budget}: must be >= 1")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature={self.temperature}, top_p={self.top_p}: need T >= 0 and 0 < top_p <= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")

    @property
    def depth(self) -> int:
        """L: draft depth (0 for AR)."""
        return 0 if self.method == "ar" else self.block_size - 1

    @property
    def tree_size(self) -> int:
        """B: tree nodes besides the root."""
        return {"ar": 0, "chain": self.depth, "ddtree": self.budget}[self.method]


@struct.dataclass
class DecodeState:
    cache: kc.KVCache
    ctx_k: jax.Array  # drafter context K [Ld, C, kv_heads, S, head_dim] (empty for AR)
    ctx_v: jax.Array
    ctx_len: jax.Array  # [C]
    root: jax.Array  # [C] last emitted token, no KV yet: the next tree's root
    out: jax.Array  # [C, max_new + L + 1] emitted tokens
    num_out: jax.Array  # [C]
    done: jax.Array  # [C] bool
    key: jax.Array
    step: jax.Array  # scalar int32
    accept_lens: jax.Array  # [max_steps, C] accept length per step, 0 when inactive


def max_steps(sc: StepConfig) -> int:
    return sc.max_new_tokens


def choose(logits_CNV, key, sc: StepConfig):
    """Per-node choice: argmax at T = 0, else an independent sample per node from softmax(logits/T), top-p."""
    if sc.temperature == 0:
        return jnp.argmax(logits_CNV, axis=-1).astype(jnp.int32)
    logits = logits_CNV.astype(jnp.float32) / sc.temperature
    if sc.top_p < 1:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        cutoff_idx = jnp.sum(cum < sc.top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _record(state: DecodeState, new_tokens_CP, n_new_C, sc: StepConfig):
    """Append n_new tokens per active sequence; finish on EOS (kept) or max_new_tokens."""
    C, P = new_tokens_CP.shape
    j = jnp.arange(P, dtype=jnp.int32)[None]
    is_eos = jnp.isin(new_tokens_CP, jnp.asarray(sc.eos_ids or (-1,), jnp.int32)) & (j < n_new_C[:, None])
    first_eos = jnp.where(is_eos.any(-1), jnp.argmax(is_eos, axis=-1) + 1, P + 1)
    n = jnp.where(state.done, 0, jnp.minimum(jnp.minimum(n_new_C, first_eos), sc.max_new_tokens - state.num_out))
    pos = jnp.where(j < n[:, None], state.num_out[:, None] + j, state.out.shape[1])
    out = state.out.at[jnp.arange(C)[:, None], pos].set(new_tokens_CP, mode="drop")
    num_out = state.num_out + n
    done = state.done | (first_eos <= n) | (num_out >= sc.max_new_tokens)
    return out, num_out, done


# ---- prefill ---------------------------------------------------------------------------------------------
def prefill(
    params, dparams, ids_CT, lengths_C, key, *, cfg: ModelConfig, dcfg, sc: StepConfig, impls: ops.Impls, max_len: int
) -> DecodeState:
    """Prompts (right-padded) -> state holding their cache, drafter context and the first token."""
    C, T = ids_CT.shape
    layer_ids = tuple(dcfg.target_layer_ids) if dcfg is not None else ()
    logits, rows, feats = target.K2Model.from_params(cfg, params).prefill(ids_CT, lengths_C, impls, layer_ids)
    cache = kc.write_prefill(kc.init_cache(cfg, C, max_len, rows.dtype), rows, lengths_C)
    last = jnp.take_along_axis(logits, (lengths_C - 1)[:, None, None], axis=1)[:, 0]
    key, sub = jax.random.split(key)
    first = choose(last[:, None], sub, sc)[:, 0]
    if dcfg is not None and sc.method != "ar":
        ctx_feats = jnp.concatenate(list(feats), axis=-1)  # [C, T, n*D]
        ctx_k, ctx_v = drafter_lib.DFlashDrafter.from_params(dcfg, dparams).context_kv(
            ctx_feats, jnp.broadcast_to(jnp.arange(T), (C, T))
        )
        pad = [(0, 0), (0, 0), (0, 0), (0, max_len - T), (0, 0)]
        ctx_k, ctx_v = jnp.pad(ctx_k, pad), jnp.pad(ctx_v, pad)
    else:
        ctx_k = ctx_v = jnp.zeros((0, C, 0, 0, 0), rows.dtype)
    L = sc.depth
    state = DecodeState(
        cache=cache,
        ctx_k=ctx_k,
        ctx_v=ctx_v,
        ctx_len=lengths_C,
        root=first,
        out=jnp.zeros((C, sc.max_new_tokens + L + 1), jnp.int32),
        num_out=jnp.zeros(C, jnp.int32),
        done=jnp.zeros(C, bool),
        key=key,
        step=jnp.zeros((), jnp.int32),
        accept_lens=jnp.zeros((max_steps(sc), C), jnp.int32),
    )
    out, num_out, done = _record(state, first[:, None], jnp.ones(C, jnp.int32), sc)
    return state.replace(out=out, num_out=num_out, done=done)


# ---- what a step drafts and how it accepts ------------------------------------------------------------------
class Drafter(Protocol):
    """Proposes the per-depth draft distributions of a step. Implementations are hashable (a static jit argument)."""

    def propose(self, params, dparams, state: DecodeState, *, cfg, dcfg, sc) -> jax.Array:
        """Draft logits float32 [C, L, V] for depths 1..L below each sequence's root."""


class Acceptor(Protocol):
    """Chooses the accepted path of a verified tree. Implementations are hashable (a static jit argument)."""

    def accept(self, tokens_CB, parents_CB1, post_CB1, num_nodes_C, state: DecodeState, *, sc, impls):
        """(path [C, L+1] node indices (-1 past the end), accept_len [C], bonus token [C])."""


@dataclasses.dataclass(frozen=True)
class DFlashDraft:
    """The DFlash drafter over its context cache (the default)."""

    def propose(self, params, dparams, state, *, cfg, dcfg, sc):
        return drafter_lib.DFlashDrafter.from_params(dcfg, dparams).draft_block(
            params["embed"],
            params["lm_head"],
            state.ctx_k,
            state.ctx_v,
            state.ctx_len,
            state.root,
            state.cache.lengths,
        )


@dataclasses.dataclass(frozen=True)
class RandomDraft:
    """Standard-normal draft logits, fresh each step: a benchmark's "no drafter" ablation."""

    seed: int = 0

    def propose(self, params, dparams, state, *, cfg, dcfg, sc):
        key = jax.random.fold_in(jax.random.key(self.seed), state.step)
        return jax.random.normal(key, (state.root.shape[0], sc.depth, cfg.vocab_size), jnp.float32)


@dataclasses.dataclass(frozen=True)
class TreeAccept:
    """The longest tree path whose tokens match the target's per-node choices (the default)."""

    def accept(self, tokens_CB, parents_CB1, post_CB1, num_nodes_C, state, *, sc, impls):
        return ops.tree_accept(tokens_CB, parents_CB1, post_CB1, num_nodes_C, max_depth=sc.depth, impls=impls)


# ---- one step --------------------------------------------------------------------------------------------
def build_tree(draft_logits_CLV, *, sc: StepConfig, impls: ops.Impls):
    """(tokens [C,B], depths [C,B], parents [C,B+1], num_nodes [C]) for the step's method."""
    C, L, V = draft_logits_CLV.shape
    B = sc.tree_size
    logq, ids = ops.draft_topk(draft_logits_CLV, 1 if sc.method == "chain" else min(B, V))
    budgets = jnp.full((C,), B, jnp.int32)
    return ops.tree_build(logq, ids, budgets, max_budget=B, impls=impls)


def step(
    params,
    dparams,
    state: DecodeState,
    *,
    cfg: ModelConfig,
    dcfg,
    sc: StepConfig,
    impls: ops.Impls,
    drafter: Drafter = DFlashDraft(),
    acceptor: Acceptor = TreeAccept(),
) -> DecodeState:
    """One speculative step (traceable; `Decoder.step` is its compiled form)."""
    C = state.root.shape[0]
    L = sc.depth
    key, k_choice = jax.random.split(state.key)
    if sc.method == "ar":
        tokens, depths = jnp.zeros((C, 0), jnp.int32), jnp.zeros((C, 0), jnp.int32)
        parents, num_nodes = jnp.full((C, 1), -1, jnp.int32), jnp.zeros(C, jnp.int32)
    else:
        draft_CLV = drafter.propose(params, dparams, state, cfg=cfg, dcfg=dcfg, sc=sc)
        tokens, depths, parents, num_nodes = build_tree(draft_CLV, sc=sc, impls=impls)
    ids = jnp.concatenate([state.root[:, None], jnp.maximum(tokens, 0)], axis=1)  # [C, B+1]
    positions = state.cache.lengths[:, None] + jnp.concatenate(
        [jnp.zeros((C, 1), jnp.int32), jnp.maximum(depths, 0)], axis=1
    )
    visibility = ops.visibility_from_parents(parents, max_depth=L)
    layer_ids = tuple(dcfg.target_layer_ids) if dcfg is not None and L else ()
    model = target.K2Model.from_params(cfg, params)
    logits, tail_rows, feats = model.verify(
        ids, positions, state.cache.rows, state.cache.lengths, visibility, impls, layer_ids
    )
    post = choose(logits, k_choice, sc)  # [C, B+1]
    if sc.method == "ar":
        path, accept_len, bonus = jnp.zeros((C, 1), jnp.int32), jnp.ones(C, jnp.int32), post[:, 0]
    else:
        path, accept_len, bonus = acceptor.accept(tokens, parents, post, num_nodes, state, sc=sc, impls=impls)
    return commit(state, key, ids, tail_rows, feats, path, accept_len, bonus, dparams, dcfg=dcfg, sc=sc)


def commit(
    state: DecodeState, key, ids_CN, tail_rows, feats, path_CP, accept_len_C, bonus_C, dparams, *, dcfg, sc: StepConfig
) -> DecodeState:
    """Scatter accepted rows into the caches, emit path tokens 1.. and the bonus, advance the lengths."""
    active = ~state.done
    n = jnp.where(active, accept_len_C, 0)
    cache = kc.commit_tail(state.cache, tail_rows, path_CP, accept_len_C, active)
    path_tokens = kc.gather_path(ids_CN, path_CP)  # [C, L+1]
    P = path_CP.shape[1]
    j = jnp.arange(P)[None]
    emitted = jnp.where(j + 1 < accept_len_C[:, None], jnp.roll(path_tokens, -1, axis=1), bonus_C[:, None])
    out, num_out, done = _record(state, emitted, accept_len_C, sc)
    ctx_k, ctx_v, ctx_len = state.ctx_k, state.ctx_v, state.ctx_len
    if feats.shape[0] and ctx_k.shape[0]:
        path_feats = kc.gather_path(jnp.concatenate(list(feats), axis=-1), path_CP)  # [C, P, n*D]
        drafter = drafter_lib.DFlashDrafter.from_params(dcfg, dparams)
        new_k, new_v = drafter.context_kv(path_feats, state.cache.lengths[:, None] + j)
        c = jnp.broadcast_to(jnp.arange(path_CP.shape[0])[:, None], path_CP.shape)
        pos = jnp.where(j < n[:, None], ctx_len[:, None] + j, ctx_k.shape[3])
        rows_first = lambda x: x.transpose(1, 3, 0, 2, 4)  # [n, C, Hkv, P, K] -> the index's [C, P, n, Hkv, K]
        ctx_k = ctx_k.at[:, c, :, pos].set(rows_first(new_k).astype(ctx_k.dtype), mode="drop")
        ctx_v = ctx_v.at[:, c, :, pos].set(rows_first(new_v).astype(ctx_v.dtype), mode="drop")
        ctx_len = ctx_len + n
    accept_lens = state.accept_lens.at[state.step].set(n, mode="drop")
    return state.replace(
        cache=cache,
        ctx_k=ctx_k,
        ctx_v=ctx_v,
        ctx_len=ctx_len,
        root=jnp.where(active, bonus_C, state.root),
        out=out,
        num_out=num_out,
        done=done,
        key=key,
        step=state.step + 1,
        accept_lens=accept_lens,
    )


def decode_loop(params, dparams, state: DecodeState, **statics) -> DecodeState:
    """All steps in one lax.while_loop, until every sequence is done (statics: those of `step`)."""
    body = functools.partial(step, params, dparams, **statics)
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done) & (s.step < max_steps(statics["sc"])), body, state)


def run_steps(params, dparams, state: DecodeState, num_steps: int, **statics) -> DecodeState:
    """Exactly num_steps steps in one lax.fori_loop, done or not (for timing)."""
    return jax.lax.fori_loop(0, num_steps, lambda _, s: step(params, dparams, s, **statics), state)


# ---- the one place the step is compiled ------------------------------------------------------------------
def jit(fn, *, static_argnames=(), donate_argnames=(), xla_defaults: bool = False):
    """jax.jit with the XLA options every program that runs the model needs (ops.COMPILER_OPTIONS: each layer's
    weights read in place), or XLA's defaults when `xla_defaults` (a benchmark ablation)."""
    options = None if xla_defaults else ops.COMPILER_OPTIONS
    return jax.jit(fn, static_argnames=static_argnames, donate_argnames=donate_argnames, compiler_options=options)


@dataclasses.dataclass(frozen=True)
class Decoder:
    """The compiled prefill and step for one model shape and decoding setting.

    `prefill`, `step` (state donated), `loop` (a while_loop to the end) and `run` (exactly n steps, for timing)
    are jitted once per Decoder; `compile(name, *args)` gives the ahead-of-time executable (to time compiles).
    """

    cfg: ModelConfig
    dcfg: object | None
    sc: StepConfig
    impls: ops.Impls
    drafter: Drafter = DFlashDraft()
    acceptor: Acceptor = TreeAccept()
    xla_defaults: bool = False

    @property
    def _statics(self) -> dict:
        return dict(
            cfg=self.cfg, dcfg=self.dcfg, sc=self.sc, impls=self.impls, drafter=self.drafter, acceptor=self.acceptor
        )

    @property
    def _programs(self) -> dict:
        return _programs(self)

    def prefill(self, params, dparams, ids_CT, lengths_C, key, *, max_len: int) -> DecodeState:
        return self._programs["prefill"](params, dparams, ids_CT, lengths_C, key, max_len=max_len)

    def step(self, params, dparams, state: DecodeState) -> DecodeState:
        return self._programs["step"](params, dparams, state)

    def loop(self, params, dparams, state: DecodeState) -> DecodeState:
        return self._programs["loop"](params, dparams, state)

    def run(self, params, dparams, state: DecodeState, num_steps: int) -> DecodeState:
        return self._programs["run"](params, dparams, state, num_steps=num_steps)

    def compile(self, name: str, *args, **kwargs):
        """The ahead-of-time compiled program `name` ("prefill", "step", "loop", "run") for these arguments."""
        return self._programs[name].lower(*args, **kwargs).compile()


@functools.lru_cache(maxsize=64)
def _programs(dec: Decoder) -> dict:
    """The jitted programs of a Decoder, shared by equal Decoders (so a new one recompiles nothing)."""
    s, opts = dec._statics, dict(xla_defaults=dec.xla_defaults)
    pre = dict(cfg=dec.cfg, dcfg=dec.dcfg, sc=dec.sc, impls=dec.impls)
    return {
        "prefill": jit(functools.partial(prefill, **pre), static_argnames=("max_len",), **opts),
        "step": jit(functools.partial(step, **s), donate_argnames=("state",), **opts),
        "loop": jit(functools.partial(decode_loop, **s), donate_argnames=("state",), **opts),
        "run": jit(
            functools.partial(run_steps, **s), static_argnames=("num_steps",), donate_argnames=("state",), **opts
        ),
    }
