"""Prefill and the speculative step: DDTree, chain DFlash and plain AR through one machinery.

One step is one jitted XLA program with donated state and no host round trip:
  draft -> top-K -> tree_build -> target verify over the tree -> per-node choice -> tree_accept -> commit.
AR is the degenerate tree {root}; chain DFlash is top-1 per depth (K = 1, B = L).

Every sequence is a slot of the batch with its own sampling values (temperature, top_p, PRNG key) and token limit
in the decode state, so requests with different settings share one executable and a server can `insert` a new
prompt into a free slot between steps (continuous batching) without recompiling.

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

from k26jax import budget, ops
from k26jax import cache as kc
from k26jax.config import ModelConfig
from k26jax.model import drafter as drafter_lib
from k26jax.model import target

METHODS = ("ddtree", "chain", "ar")
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static decoding settings (hashable: part of the compiled step's identity).

    max_new_tokens is the capacity of the output buffer; each slot stops at its own `DecodeState.max_new` within
    it. sampling=False compiles argmax only (every slot greedy); True compiles the per-slot choice (argmax where a
    slot's temperature is 0, else a tempered top-p sample). logprobs: the step also returns the log-probability of
    each emitted token under the target (log-softmax of its logits at temperature 1) and the `top_logprobs`
    most likely tokens there, computed on the accepted path only. estimate: (method, budget) candidates whose
    tree survival the step also reports in `DecodeState.survival`, from one build at the largest budget
    (k26jax.budget; what budget="auto" chooses from); a DDTree step then verifies that build's prefix.
    estimate_stale: keep the state's survival as it is (estimate's shapes, none of its cost): budget="auto" runs
    these steps between estimating ones.
    """

    method: str = "ddtree"
    budget: int = 32
    max_new_tokens: int = 64
    eos_ids: tuple[int, ...] = ()
    block_size: int = 8
    sampling: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    estimate: tuple[tuple[str, int], ...] = ()
    estimate_stale: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: use one of {METHODS}")
        if self.budget < 1:
            raise ValueError(f"budget={self.budget}: must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens}: must be >= 1")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS or (self.top_logprobs and not self.logprobs):
            raise ValueError(f"top_logprobs={self.top_logprobs}: need 0..{MAX_TOP_LOGPROBS}, and logprobs=True")
        if self.estimate and (self.method == "ar" or any(m not in ("chain", "ddtree") for m, _ in self.estimate)):
            raise ValueError(f"estimate={self.estimate}: chain / ddtree candidates, for a chain or ddtree step")
        if self.estimate_stale and not self.estimate:
            raise ValueError("estimate_stale=True: keeps an estimate's survival, so needs estimate candidates")

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
    """The batch: C slots, each a sequence with its own cache rows, sampling values and limits.

    A slot with done True is inactive: the step computes it (static shapes) but commits nothing. The `emitted`
    fields hold what the last prefill / step appended (P = L + 1 columns), so a host loop reads only those.
    """

    cache: kc.KVCache
    ctx_k: jax.Array  # drafter context K [Ld, C, kv_heads, S, head_dim] (empty for AR)
    ctx_v: jax.Array
    ctx_len: jax.Array  # [C]
    root: jax.Array  # [C] last emitted token, no KV yet: the next tree's root
    out: jax.Array  # [C, max_new_tokens + L + 1] emitted tokens
    num_out: jax.Array  # [C]
    done: jax.Array  # [C] bool
    key: jax.Array  # [C] PRNG keys, one stream per slot
    step: jax.Array  # scalar int32
    accept_lens: jax.Array  # [max_steps, C] accept length per step, 0 when inactive
    temperature: jax.Array  # [C] float32, 0 = greedy
    top_p: jax.Array  # [C] float32 in (0, 1]
    max_new: jax.Array  # [C] int32 token limit, <= max_new_tokens
    emitted: jax.Array  # [C, P] tokens appended by the last prefill / step
    num_emitted: jax.Array  # [C] how many of them count
    logprob: jax.Array  # [C, P] float32 their log-probabilities ([C, 0] without logprobs)
    top_ids: jax.Array  # [C, P, K] the K most likely tokens at each ([C, 0, 0] without logprobs)
    top_logprob: jax.Array  # [C, P, K] float32
    survival: jax.Array  # [C, nB, L] float32: per sc.estimate candidate, P(tau >= a + 1) by the last step's draft
    realised: jax.Array  # [C, nB] int32: per sc.estimate candidate, its accept length at the last step where that
    # step's own tree tells it (`counterfactual_accept`), else 0


def max_steps(sc: StepConfig) -> int:
    return sc.max_new_tokens


def slot_keys(key, C: int):
    """Per-slot PRNG keys from one key: slot c's stream is fold_in(key, c) (a server's request is slot 0 of its
    own seed, so it samples as `generate` of that one prompt does)."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(C, dtype=jnp.uint32))


def choose(logits_CNV, key_C, temperature_C, top_p_C, *, sampling: bool):
    """Per-node choice: argmax where a slot's temperature is 0, else an independent sample per node from
    softmax(logits / T) restricted to the top-p mass. The sampling branch runs only when some slot samples."""
    greedy = jnp.argmax(logits_CNV, axis=-1).astype(jnp.int32)
    if not sampling:
        return greedy
    hot = temperature_C > 0

    def top_p_filter(logits):
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        cutoff_idx = jnp.sum(cum < top_p_C[:, None, None], axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, jnp.minimum(cutoff_idx, logits.shape[-1] - 1), axis=-1)
        keep = (logits >= cutoff) | (top_p_C >= 1)[:, None, None]
        return jnp.where(keep, logits, -jnp.inf)

    def sample(_):
        t = jnp.where(hot, temperature_C, 1.0)
        logits = logits_CNV.astype(jnp.float32) / t[:, None, None]
        logits = jax.lax.cond(jnp.any(hot & (top_p_C < 1)), top_p_filter, lambda x: x, logits)
        drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x, axis=-1))(key_C, logits).astype(jnp.int32)
        return jnp.where(hot[:, None], drawn, greedy)

    return jax.lax.cond(jnp.any(hot), sample, lambda _: greedy, None)


def _split_keys(key_C):
    """(the slots' next keys, this draw's keys), both [C]."""
    both = jax.vmap(jax.random.split)(key_C)
    return both[:, 0], both[:, 1]


def _record(state: DecodeState, new_tokens_CP, n_new_C, sc: StepConfig):
    """Append n_new tokens per active sequence; finish on EOS (kept) or the slot's max_new. Returns
    (out, num_out, done, n appended)."""
    C, P = new_tokens_CP.shape
    j = jnp.arange(P, dtype=jnp.int32)[None]
    is_eos = jnp.isin(new_tokens_CP, jnp.asarray(sc.eos_ids or (-1,), jnp.int32)) & (j < n_new_C[:, None])
    first_eos = jnp.where(is_eos.any(-1), jnp.argmax(is_eos, axis=-1) + 1, P + 1)
    n = jnp.where(state.done, 0, jnp.minimum(jnp.minimum(n_new_C, first_eos), state.max_new - state.num_out))
    n = jnp.maximum(n, 0)
    pos = jnp.where(j < n[:, None], state.num_out[:, None] + j, state.out.shape[1])
    out = state.out.at[jnp.arange(C)[:, None], pos].set(new_tokens_CP, mode="drop")
    num_out = state.num_out + n
    done = state.done | (first_eos <= n) | (num_out >= state.max_new)
    return out, num_out, done, n


def _logprobs(rows_CPV, tokens_CP, sc: StepConfig):
    """(log p of tokens [C, P], top ids [C, P, K], their log p [C, P, K]) under softmax(rows); empty without
    sc.logprobs."""
    C, P = tokens_CP.shape
    if not sc.logprobs:
        return jnp.zeros((C, 0), jnp.float32), jnp.zeros((C, 0, 0), jnp.int32), jnp.zeros((C, 0, 0), jnp.float32)
    logp = jax.nn.log_softmax(rows_CPV.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens_CP[..., None], axis=-1)[..., 0]
    if not sc.top_logprobs:
        return chosen, jnp.zeros((C, P, 0), jnp.int32), jnp.zeros((C, P, 0), jnp.float32)
    top_logprob, top_ids = jax.lax.top_k(logp, sc.top_logprobs)
    return chosen, top_ids.astype(jnp.int32), top_logprob


def _per_slot(C: int, value, dtype):
    return jnp.broadcast_to(jnp.asarray(value, dtype), (C,))


# ---- prefill ---------------------------------------------------------------------------------------------
def prefill(
    params,
    dparams,
    ids_CT,
    lengths_C,
    key,
    *,
    cfg: ModelConfig,
    dcfg,
    sc: StepConfig,
    impls: ops.Impls,
    max_len: int,
    temperature=0.0,
    top_p=1.0,
    max_new=None,
    drafter=None,
) -> DecodeState:
    """Prompts (right-padded) -> state holding their cache, drafter context and the first token.

    key: one PRNG key (slot c draws from fold_in(key, c)); temperature, top_p, max_new: scalars or [C] (max_new
    defaults to sc.max_new_tokens).
    """
    C, T = ids_CT.shape
    layer_ids = tuple(dcfg.target_layer_ids) if dcfg is not None else ()
    model = target.K2Model.from_params(cfg, params)
    last, rows, feats = model.prefill(ids_CT, lengths_C, impls, layer_ids, last_only=True)  # last [C, 1, V]
    cache = kc.write_prefill(kc.init_cache(cfg, C, max_len, rows.dtype), rows, lengths_C)
    temperature = _per_slot(C, temperature, jnp.float32)
    top_p = _per_slot(C, top_p, jnp.float32)
    keys, draw = _split_keys(slot_keys(key, C))
    first = choose(last, draw, temperature, top_p, sampling=sc.sampling)[:, 0]
    if dcfg is not None and sc.method != "ar":
        ctx_feats = jnp.concatenate(list(feats), axis=-1)  # [C, T, n*D]
        positions = jnp.broadcast_to(jnp.arange(T), (C, T))
        ctx_k, ctx_v = context_kv(drafter, dparams, ctx_feats, positions, dcfg=dcfg)
        pad = [(0, 0), (0, 0), (0, 0), (0, max_len - T), (0, 0)]
        ctx_k, ctx_v = jnp.pad(ctx_k, pad), jnp.pad(ctx_v, pad)
    else:
        ctx_k = ctx_v = jnp.zeros((0, C, 0, 0, 0), rows.dtype)
    P = sc.depth + 1
    emitted = jnp.zeros((C, P), jnp.int32).at[:, 0].set(first)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, P - 1)] + [(0, 0)] * (x.ndim - 2)) if x.shape[1] else x
    logprob, top_ids, top_logprob = map(pad, _logprobs(last, first[:, None], sc))  # [C, 1, ...] -> [C, P, ...]
    state = DecodeState(
        cache=cache,
        ctx_k=ctx_k,
        ctx_v=ctx_v,
        ctx_len=lengths_C,
        root=first,
        out=jnp.zeros((C, sc.max_new_tokens + P), jnp.int32),
        num_out=jnp.zeros(C, jnp.int32),
        done=jnp.zeros(C, bool),
        key=keys,
        step=jnp.zeros((), jnp.int32),
        accept_lens=jnp.zeros((max_steps(sc), C), jnp.int32),
        temperature=temperature,
        top_p=top_p,
        max_new=_per_slot(C, sc.max_new_tokens if max_new is None else max_new, jnp.int32),
        emitted=emitted,
        num_emitted=jnp.zeros(C, jnp.int32),
        logprob=logprob,
        top_ids=top_ids,
        top_logprob=top_logprob,
        survival=jnp.zeros((C, len(sc.estimate), sc.depth), jnp.float32),
        realised=jnp.zeros((C, len(sc.estimate)), jnp.int32),
    )
    out, num_out, done, n = _record(state, emitted, jnp.ones(C, jnp.int32), sc)
    return state.replace(out=out, num_out=num_out, done=done, num_emitted=n)


def empty_state(
    *, cfg: ModelConfig, dcfg, sc: StepConfig, batch: int, max_len: int, dtype, ctx_dtype=None
) -> DecodeState:
    """C = batch free slots (done, length 0) with caches of max_len rows: a server's state before any insert.
    dtype: the target's (its latent cache), ctx_dtype: the drafter's parameters' (its context K/V; default dtype)."""
    C, P, K = batch, sc.depth + 1, sc.top_logprobs
    if dcfg is not None and sc.method != "ar":
        ctx_shape = (dcfg.num_hidden_layers, C, dcfg.num_key_value_heads, max_len, dcfg.head_dim)
    else:
        ctx_shape, ctx_dtype = (0, C, 0, 0, 0), dtype
    Pl = P if sc.logprobs else 0
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)  # a new array per field: no two fields share a buffer
    return DecodeState(
        cache=kc.init_cache(cfg, C, max_len, dtype),
        ctx_k=jnp.zeros(ctx_shape, ctx_dtype or dtype),
        ctx_v=jnp.zeros(ctx_shape, ctx_dtype or dtype),
        ctx_len=zeros(C),
        root=zeros(C),
        out=zeros(C, sc.max_new_tokens + P),
        num_out=zeros(C),
        done=jnp.ones(C, bool),
        key=slot_keys(jax.random.key(0), C),
        step=zeros(),
        accept_lens=zeros(max_steps(sc), C),
        temperature=jnp.zeros(C, jnp.float32),
        top_p=jnp.ones(C, jnp.float32),
        max_new=zeros(C),
        emitted=zeros(C, P),
        num_emitted=zeros(C),
        logprob=jnp.zeros((C, Pl), jnp.float32),
        top_ids=zeros(C, Pl, K),
        top_logprob=jnp.zeros((C, Pl, K), jnp.float32),
        survival=jnp.zeros((C, len(sc.estimate), sc.depth), jnp.float32),
        realised=zeros(C, len(sc.estimate)),
    )


def insert(
    params,
    dparams,
    state: DecodeState,
    slot,
    ids_1T,
    length,
    seed,
    temperature,
    top_p,
    max_new,
    *,
    cfg: ModelConfig,
    dcfg,
    sc: StepConfig,
    impls: ops.Impls,
    drafter=None,
) -> DecodeState:
    """Prefill one prompt (ids [1, T], T a bucket <= the cache's rows) into slot `slot` of the batch.

    The other slots are untouched; the slot's cache and drafter context rows [0, T) are overwritten (rows past
    its length are never read). Its first token and logprobs are in the returned state's `emitted` fields of
    that slot. seed (uint32): the slot samples from fold_in(key(seed), 0), as `generate([prompt], seed=seed)`.
    """
    one = prefill(
        params,
        dparams,
        ids_1T,
        jnp.reshape(length, (1,)),
        jax.random.key(seed),
        cfg=cfg,
        dcfg=dcfg,
        sc=sc,
        impls=impls,
        max_len=ids_1T.shape[1],
        temperature=temperature,
        top_p=top_p,
        max_new=max_new,
        drafter=drafter,
    )
    slot = jnp.asarray(slot, jnp.int32)
    fields = {}
    for f in dataclasses.fields(state):
        full, part = getattr(state, f.name), getattr(one, f.name)
        if f.name == "step":
            fields[f.name] = full
        elif f.name == "accept_lens":
            fields[f.name] = full.at[:, slot].set(0)
        elif f.name in ("ctx_k", "ctx_v"):  # [Ld, C, Hkv, S, K] <- [Ld, 1, Hkv, T, K]
            fields[f.name] = jax.lax.dynamic_update_slice(full, part, (0, slot, 0, 0, 0)) if full.size else full
        elif f.name == "cache":  # rows [layers, C, S, W] <- [layers, 1, T, W]
            rows = jax.lax.dynamic_update_slice(full.rows, part.rows, (0, slot, 0, 0))
            fields[f.name] = kc.KVCache(rows, full.lengths.at[slot].set(part.lengths[0]))
        else:  # [C, ...] <- [1, ...]
            fields[f.name] = full.at[slot].set(part[0])
    return DecodeState(**fields)


# ---- what a step drafts and how it accepts ------------------------------------------------------------------
class Drafter(Protocol):
    """Proposes the per-depth draft distributions of a step. Implementations are hashable (a static jit argument).
    One may also define `context_kv(dparams, features, positions, *, dcfg) -> (k, v)`, the drafter context K/V of
    target features (prefill, commit); without it the DFlash drafter's is used (`context_kv`)."""

    def propose(self, params, dparams, state: DecodeState, *, cfg, dcfg, sc) -> jax.Array:
        """Draft logits float32 [C, L, V] for depths 1..L below each sequence's root."""


def context_kv(drafter, dparams, features_CTF, positions_CT, *, dcfg):
    """The drafter context (k, v) [Ld, C, Hkv, T, K] of target features: `drafter.context_kv` where it has one,
    else the DFlash drafter's."""
    own = getattr(drafter, "context_kv", None)
    if own is not None:
        return own(dparams, features_CTF, positions_CT, dcfg=dcfg)
    return drafter_lib.DFlashDrafter.from_params(dcfg, dparams).context_kv(features_CTF, positions_CT)


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
    """((tokens [C,B], depths [C,B], parents [C,B+1], num_nodes [C]) for the step's method, survival [C, nB, L]
    of sc.estimate's candidates (nB = 0 without; None with sc.estimate_stale), the draft's top-1 token per depth
    [C, L] (from the top-K the build takes anyway))."""
    C, L, V = draft_logits_CLV.shape
    B = sc.tree_size
    survival = None if sc.estimate_stale else jnp.zeros((C, 0, L), jnp.float32)
    if sc.estimate and not sc.estimate_stale:
        est = budget.candidate_taus(draft_logits_CLV, sc.estimate, impls=impls)
        survival = est.survival
        if sc.method == "ddtree" and B <= est.tree[0].shape[1]:
            return budget.prefix_tree(est.tree, B), survival, est.top1
    logq, ids = ops.draft_topk(draft_logits_CLV, 1 if sc.method == "chain" else min(B, V))
    budgets = jnp.full((C,), B, jnp.int32)
    return ops.tree_build(logq, ids, budgets, max_budget=B, impls=impls), survival, ids[..., 0]


def counterfactual_accept(top1_CL, path_CP, accept_len_C, emitted_CP, *, sc: StepConfig):
    """[C, nB]: the accept length each sc.estimate candidate's tree would have had at this step, where this step's
    tree tells it, else 0. A DDTree candidate of budget b <= this step's takes the accepted path while its nodes rank
    below b (a smaller best-first tree is a prefix of a larger one: exact); the chain takes it while each depth's
    target token (the accepted tokens, then the bonus) is the draft's top-1 there, top1_CL (a lower bound when all
    are)."""
    C, P = path_CP.shape
    depth = jnp.arange(1, P)[None]  # [1, L]
    cols = []
    for method, b in sc.estimate:
        if (method, b) == (sc.method, sc.tree_size):
            col = accept_len_C
        elif method == "ddtree" == sc.method and b <= sc.tree_size:
            inside = (depth < accept_len_C[:, None]) & (path_CP[:, 1:] <= b)
            col = 1 + jnp.cumprod(inside, axis=1).sum(1)
        elif method == "chain" and sc.method == "ddtree":
            match = (depth <= accept_len_C[:, None]) & (emitted_CP[:, : P - 1] == top1_CL)
            col = 1 + jnp.cumprod(match, axis=1).sum(1)
        else:
            col = jnp.zeros(C, jnp.int32)
        cols.append(col.astype(jnp.int32))
    return jnp.stack(cols, axis=1)


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
    key, k_choice = _split_keys(state.key)
    if sc.method == "ar":
        tokens, depths = jnp.zeros((C, 0), jnp.int32), jnp.zeros((C, 0), jnp.int32)
        parents, num_nodes = jnp.full((C, 1), -1, jnp.int32), jnp.zeros(C, jnp.int32)
        survival = state.survival
    else:
        with jax.named_scope("draft"):
            draft_CLV = drafter.propose(params, dparams, state, cfg=cfg, dcfg=dcfg, sc=sc)
        with jax.named_scope("tree_build"):
            (tokens, depths, parents, num_nodes), survival, top1 = build_tree(draft_CLV, sc=sc, impls=impls)
    with jax.named_scope("verify"):
        ids = jnp.concatenate([state.root[:, None], jnp.maximum(tokens, 0)], axis=1)  # [C, B+1]
        positions = state.cache.lengths[:, None] + jnp.concatenate(
            [jnp.zeros((C, 1), jnp.int32), jnp.maximum(depths, 0)], axis=1
        )
        visibility = ops.visibility_from_parents(parents, max_depth=L)
        layer_ids = tuple(dcfg.target_layer_ids) if dcfg is not None and L else ()
        model = target.K2Model.from_params(cfg, params)
        logits, tail_rows, feats = model.verify(
            ids, positions, state.cache.rows, state.cache.lengths, visibility, impls, layer_ids, ~state.done
        )
    with jax.named_scope("accept"):
        post = choose(logits, k_choice, state.temperature, state.top_p, sampling=sc.sampling)  # [C, B+1]
        if sc.method == "ar":
            path, accept_len, bonus = jnp.zeros((C, 1), jnp.int32), jnp.ones(C, jnp.int32), post[:, 0]
        else:
            path, accept_len, bonus = acceptor.accept(tokens, parents, post, num_nodes, state, sc=sc, impls=impls)
    with jax.named_scope("commit"):
        state = commit(
            state, key, ids, tail_rows, feats, path, accept_len, bonus, dparams, dcfg=dcfg, sc=sc, drafter=drafter
        )
        state = state if survival is None else state.replace(survival=survival)
        if sc.estimate:
            realised = counterfactual_accept(top1, path, accept_len, state.emitted, sc=sc)
            state = state.replace(realised=realised)
    if not sc.logprobs:
        return state
    # emitted token j was chosen at path node j: its distribution is that node's row of logits
    logprob, top_ids, top_logprob = _logprobs(kc.gather_path(logits, path), state.emitted, sc)
    return state.replace(logprob=logprob, top_ids=top_ids, top_logprob=top_logprob)


def commit(
    state: DecodeState,
    key,
    ids_CN,
    tail_rows,
    feats,
    path_CP,
    accept_len_C,
    bonus_C,
    dparams,
    *,
    dcfg,
    sc: StepConfig,
    drafter=None,
) -> DecodeState:
    """Scatter accepted rows into the caches, emit path tokens 1.. and the bonus, advance the lengths."""
    active = ~state.done
    n = jnp.where(active, accept_len_C, 0)
    cache = kc.commit_tail(state.cache, tail_rows, path_CP, accept_len_C, active)
    path_tokens = kc.gather_path(ids_CN, path_CP)  # [C, L+1]
    P = path_CP.shape[1]
    j = jnp.arange(P)[None]
    emitted = jnp.where(j + 1 < accept_len_C[:, None], jnp.roll(path_tokens, -1, axis=1), bonus_C[:, None])
    out, num_out, done, num_emitted = _record(state, emitted, accept_len_C, sc)
    ctx_k, ctx_v, ctx_len = state.ctx_k, state.ctx_v, state.ctx_len
    if feats.shape[0] and ctx_k.shape[0]:
        path_feats = kc.gather_path(jnp.concatenate(list(feats), axis=-1), path_CP)  # [C, P, n*D]
        new_k, new_v = context_kv(drafter, dparams, path_feats, state.cache.lengths[:, None] + j, dcfg=dcfg)
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
        emitted=emitted,
        num_emitted=num_emitted,
    )


def decode_loop(params, dparams, state: DecodeState, **statics) -> DecodeState:
    """All steps in one lax.while_loop, until every sequence is done (statics: those of `step`)."""
    return decode_steps(params, dparams, state, max_steps(statics["sc"]), **statics)


def decode_steps(params, dparams, state: DecodeState, num_steps, **statics) -> DecodeState:
    """Up to num_steps steps (traced: one program for any count) in one lax.while_loop, fewer when every sequence
    is done first or the step limit comes."""
    body = functools.partial(step, params, dparams, **statics)
    end = jnp.minimum(state.step + num_steps, max_steps(statics["sc"]))
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done) & (s.step < end), body, state)


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
    are jitted once per Decoder; so are a server's `empty` (free slots) and `insert` (a prompt into a free slot
    between steps, state donated; one executable per prompt length). `compile(name, *args)` gives the
    ahead-of-time executable (to time compiles).
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

    def prefill(
        self, params, dparams, ids_CT, lengths_C, key, *, max_len: int, temperature=0.0, top_p=1.0, max_new=None
    ) -> DecodeState:
        return self._programs["prefill"](
            params,
            dparams,
            ids_CT,
            lengths_C,
            key,
            max_len=max_len,
            temperature=temperature,
            top_p=top_p,
            max_new=max_new,
        )

    def empty(self, *, batch: int, max_len: int, dtype, ctx_dtype=None) -> DecodeState:
        return self._programs["empty"](batch=batch, max_len=max_len, dtype=dtype, ctx_dtype=ctx_dtype)

    def insert(
        self, params, dparams, state: DecodeState, slot, ids_1T, length, seed, temperature, top_p, max_new
    ) -> DecodeState:
        return self._programs["insert"](params, dparams, state, slot, ids_1T, length, seed, temperature, top_p, max_new)

    def step(self, params, dparams, state: DecodeState) -> DecodeState:
        return self._programs["step"](params, dparams, state)

    def loop(self, params, dparams, state: DecodeState) -> DecodeState:
        return self._programs["loop"](params, dparams, state)

    def run(self, params, dparams, state: DecodeState, num_steps: int) -> DecodeState:
        return self._programs["run"](params, dparams, state, num_steps=num_steps)

    def compile(self, name: str, *args, **kwargs):
        """The ahead-of-time compiled program `name` (see `_programs`) for these arguments."""
        return self._programs[name].lower(*args, **kwargs).compile()


@functools.lru_cache(maxsize=64)
def _programs(dec: Decoder) -> dict:
    """The jitted programs of a Decoder, shared by equal Decoders (so a new one recompiles nothing)."""
    s, opts = dec._statics, dict(xla_defaults=dec.xla_defaults)
    pre = dict(cfg=dec.cfg, dcfg=dec.dcfg, sc=dec.sc, impls=dec.impls, drafter=dec.drafter)
    return {
        "prefill": jit(functools.partial(prefill, **pre), static_argnames=("max_len",), **opts),
        "empty": jit(
            functools.partial(empty_state, cfg=dec.cfg, dcfg=dec.dcfg, sc=dec.sc),
            static_argnames=("batch", "max_len", "dtype", "ctx_dtype"),
            **opts,
        ),
        "insert": jit(functools.partial(insert, **pre), donate_argnames=("state",), **opts),
        "step": jit(functools.partial(step, **s), donate_argnames=("state",), **opts),
        "loop": jit(functools.partial(decode_loop, **s), donate_argnames=("state",), **opts),
        "run": jit(
            functools.partial(run_steps, **s), static_argnames=("num_steps",), donate_argnames=("state",), **opts
        ),
    }
