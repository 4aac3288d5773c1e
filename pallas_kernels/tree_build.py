"""DDTree best-first tree build: Pallas-Triton kernel, plain-XLA reference, top-K front end, visibility.

One program per request. The heap is a flat array of S = next_pow2(2B+1) candidate slots (-inf = empty):
slot 0 holds the first node; pop i takes the best slot (argmax, ties -> lowest slot) and writes its next
sibling to slot 2i+1 and its first child to slot 2i+2. Scores, K_c = min(budget_c, K, max_topk) and the
tie rule are exactly those of `k26jax.ddtree.build_tree_from_topk` (its docstring lists them), so the trees
match it node for node. Top-K over the vocabulary cannot run in Triton and happens in XLA (`draft_topk`).

Outputs per request c: tokens [B], depths [B] (node i+1 at index i), parents [B+1] (root -1), num_nodes;
-1 past num_nodes.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# A candidate slot's (parent, depth, rank) packed in one int32 so a single reduction extracts it.
_PARENT_BITS, _DEPTH_BITS, _RANK_BITS = 12, 7, 12
MAX_BUDGET = (1 << _PARENT_BITS) - 1
MAX_DEPTH = (1 << _DEPTH_BITS) - 1


def _pack(parent, depth, rank):
    return parent | (depth << _PARENT_BITS) | (rank << (_PARENT_BITS + _DEPTH_BITS))


def _unpack(meta):
    parent = meta & MAX_BUDGET
    depth = (meta >> _PARENT_BITS) & MAX_DEPTH
    return parent, depth, meta >> (_PARENT_BITS + _DEPTH_BITS)


def _num_slots(max_budget):
    return pl.next_power_of_2(2 * max_budget + 1)


def draft_topk(draft_logits, k):
    """draft_logits [C, L, V] -> (logq [C, L, k] float32 log-softmax over the full vocab, ids [C, L, k] int32).

    `lax.top_k` order: descending, equal values -> lower token id first."""
    if draft_logits.ndim != 3:
        raise ValueError(f"draft_logits must be [C, L, V], got shape {draft_logits.shape}")
    if not 1 <= k <= draft_logits.shape[-1]:
        raise ValueError(f"k must be in [1, V={draft_logits.shape[-1]}], got {k}")
    logits = draft_logits.astype(jnp.float32)
    top, ids = jax.lax.top_k(logits, k)
    return top - jax.nn.logsumexp(logits, axis=-1, keepdims=True), ids.astype(jnp.int32)


def _check_args(logq, ids, budgets, max_budget, max_topk):
    if logq.ndim != 3 or logq.dtype != jnp.float32 or min(logq.shape) < 1:
        raise ValueError(f"logq must be a non-empty float32 [C, L, K] array, got {logq.dtype} {logq.shape}")
    if ids.shape != logq.shape or ids.dtype != jnp.int32:
        raise ValueError(f"ids must be int32 with logq's shape {logq.shape}, got {ids.dtype} {ids.shape}")
    if budgets.shape != logq.shape[:1] or budgets.dtype != jnp.int32:
        raise ValueError(f"budgets must be int32 [C={logq.shape[0]}], got {budgets.dtype} {budgets.shape}")
    if not 1 <= max_budget <= MAX_BUDGET:
        raise ValueError(f"max_budget must be in [1, {MAX_BUDGET}], got {max_budget}")
    if logq.shape[1] > MAX_DEPTH:
        raise ValueError(f"logq has L={logq.shape[1]} depths; at most {MAX_DEPTH} are supported")
    if max_topk is not None and max_topk < 1:
        raise ValueError(f"max_topk must be >= 1 or None, got {max_topk}")


def _tree_build_kernel(
    budgets_ref,
    logq_ref,
    ids_ref,
    tokens_ref,
    depths_ref,
    parents_ref,
    num_nodes_ref,
    *,
    max_budget,
    max_topk,
    depth_bonus,
):
    c = pl.program_id(0)
    _, num_depths, k_total = logq_ref.shape
    budget = jnp.clip(budgets_ref[c], 0, max_budget)
    k = jnp.minimum(budget, min(k_total, max_topk or k_total))
    slot = jnp.arange(_num_slots(max_budget), dtype=jnp.int32)
    neg_inf = -jnp.inf

    first = logq_ref[c, 0, 0]
    score = jnp.where(slot == 0, first, neg_inf)
    meta = jnp.where(slot == 0, _pack(0, 1, 0), 0)
    num_live = ((budget > 0) & (first > neg_inf)).astype(jnp.int32)

    def pop(carry):
        i, num_live, score, meta = carry
        j = jnp.argmax(score)
        logw = jnp.max(score)
        parent, d, r = _unpack(jnp.sum(jnp.where(slot == j, meta, 0)))
        tokens_ref[c, i] = ids_ref[c, d - 1, r]
        depths_ref[c, i] = d
        parents_ref[c, i + 1] = parent
        q_r = logq_ref[c, d - 1, r]
        q_next = logq_ref[c, d - 1, jnp.minimum(r + 1, k_total - 1)]
        q_child = logq_ref[c, jnp.minimum(d, num_depths - 1), 0]
        sibling = jnp.where(r + 1 < k, (logw - q_r) + q_next, neg_inf)
        child = jnp.where(d < num_depths, (logw + q_child) + depth_bonus, neg_inf)
        score = jnp.where(slot == j, neg_inf, score)
        score = jnp.where(slot == 2 * i + 1, sibling, jnp.where(slot == 2 * i + 2, child, score))
        meta = jnp.where(
            slot == 2 * i + 1, _pack(parent, d, r + 1), jnp.where(slot == 2 * i + 2, _pack(i + 1, d + 1, 0), meta)
        )
        num_live += (sibling > neg_inf).astype(jnp.int32) + (child > neg_inf).astype(jnp.int32) - 1
        return i + 1, num_live, score, meta

    num_nodes = jax.lax.while_loop(
        lambda carry: (carry[0] < budget) & (carry[1] > 0), pop, (jnp.int32(0), num_live, score, meta)
    )[0]

    def pad(i, _):
        tokens_ref[c, i] = -1
        depths_ref[c, i] = -1
        parents_ref[c, i + 1] = -1

    jax.lax.fori_loop(num_nodes, max_budget, pad, None)
    parents_ref[c, 0] = -1
    num_nodes_ref[c] = num_nodes


def _default_num_warps(max_budget):
    slots = _num_slots(max_budget)
    return 1 if slots <= 512 else 2 if slots <= 1024 else 4


@functools.partial(jax.jit, static_argnames=("max_budget", "max_topk", "depth_bonus", "interpret", "num_warps"))
def tree_build(logq, ids, budgets, *, max_budget, max_topk=None, depth_bonus=0.0, interpret=False, num_warps=None):
    """Best-first DDTree per request (Pallas-Triton, one program per request).

    logq [C, L, K] float32 and ids [C, L, K] int32 from `draft_topk`; budgets [C] int32 in [0, max_budget]
    (clipped). Returns tokens [C, B], depths [C, B], parents [C, B+1], num_nodes [C] (all int32, B = max_budget).
    `max_topk` and `depth_bonus` are SGLang's knobs (off by default; not the paper's optimal tree).
    """
    _check_args(logq, ids, budgets, max_budget, max_topk)
    num_requests = logq.shape[0]
    out_shape = (
        jax.ShapeDtypeStruct((num_requests, max_budget), jnp.int32),
        jax.ShapeDtypeStruct((num_requests, max_budget), jnp.int32),
        jax.ShapeDtypeStruct((num_requests, max_budget + 1), jnp.int32),
        jax.ShapeDtypeStruct((num_requests,), jnp.int32),
    )
    kernel = functools.partial(
        _tree_build_kernel, max_budget=max_budget, max_topk=max_topk, depth_bonus=float(depth_bonus)
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(num_requests,),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or _default_num_warps(max_budget), num_stages=1),
        interpret=interpret,
        name="tree_build",
    )(budgets, logq, ids)


def _build_one_reference(logq, ids, budget, *, max_budget, max_topk, depth_bonus):
    """One request, plain XLA: the same flat-slot heap as the kernel, one fori_loop step per pop."""
    num_depths, k_total = logq.shape
    budget = jnp.clip(budget, 0, max_budget)
    k = jnp.minimum(budget, min(k_total, max_topk or k_total))
    num_slots = _num_slots(max_budget)
    neg_inf = jnp.float32(-jnp.inf)
    score = jnp.full(num_slots, neg_inf).at[0].set(jnp.where(budget > 0, logq[0, 0], neg_inf))
    slot_parent = jnp.zeros(num_slots, jnp.int32)
    slot_depth = jnp.ones(num_slots, jnp.int32)
    slot_rank = jnp.zeros(num_slots, jnp.int32)
    tokens = jnp.full(max_budget, -1, jnp.int32)
    depths = jnp.full(max_budget, -1, jnp.int32)
    parents = jnp.full(max_budget + 1, -1, jnp.int32)

    def pop(i, state):
        score, slot_parent, slot_depth, slot_rank, tokens, depths, parents, num_nodes = state
        j = jnp.argmax(score)
        logw = score[j]
        active = (i < budget) & (logw > neg_inf)
        parent, d, r = slot_parent[j], slot_depth[j], slot_rank[j]
        sibling = jnp.where(
            active & (r + 1 < k), (logw - logq[d - 1, r]) + logq[d - 1, jnp.minimum(r + 1, k_total - 1)], neg_inf
        )
        child = jnp.where(
            active & (d < num_depths), (logw + logq[jnp.minimum(d, num_depths - 1), 0]) + depth_bonus, neg_inf
        )
        score = score.at[j].set(jnp.where(active, neg_inf, logw))
        score = score.at[2 * i + 1].set(sibling).at[2 * i + 2].set(child)
        slot_parent = slot_parent.at[2 * i + 1].set(parent).at[2 * i + 2].set(i + 1)
        slot_depth = slot_depth.at[2 * i + 1].set(d).at[2 * i + 2].set(d + 1)
        slot_rank = slot_rank.at[2 * i + 1].set(r + 1).at[2 * i + 2].set(0)
        tokens = tokens.at[i].set(jnp.where(active, ids[d - 1, r], -1))
        depths = depths.at[i].set(jnp.where(active, d, -1))
        parents = parents.at[i + 1].set(jnp.where(active, parent, -1))
        return score, slot_parent, slot_depth, slot_rank, tokens, depths, parents, num_nodes + active

    state = (score, slot_parent, slot_depth, slot_rank, tokens, depths, parents, jnp.int32(0))
    *_, tokens, depths, parents, num_nodes = jax.lax.fori_loop(0, max_budget, pop, state)
    return tokens, depths, parents, num_nodes


@functools.partial(jax.jit, static_argnames=("max_budget", "max_topk", "depth_bonus", "interpret"))
def tree_build_reference(logq, ids, budgets, *, max_budget, max_topk=None, depth_bonus=0.0, interpret=False):
    """`tree_build` as a plain XLA lax.fori_loop over pops (vmapped over requests); `interpret` is unused."""
    del interpret
    _check_args(logq, ids, budgets, max_budget, max_topk)
    build = functools.partial(
        _build_one_reference, max_budget=max_budget, max_topk=max_topk, depth_bonus=jnp.float32(depth_bonus)
    )
    return jax.vmap(build)(logq, ids, budgets)


@functools.partial(jax.jit, static_argnames=("max_depth",))
def visibility_from_parents(parents, *, max_depth=None):
    """parents [C, B+1] int32 (-1 = root or padding) -> visibility [C, B+1, B+1] bool.

    Row i: node i and its ancestors; padded rows see only themselves. Pointer doubling, unrolled
    max_depth.bit_length() times; `max_depth` (the tree's L) defaults to B, which is always enough.
    """
    if parents.ndim != 2:
        raise ValueError(f"parents must be [C, B+1], got shape {parents.shape}")
    num_rows = parents.shape[1]
    max_depth = num_rows - 1 if max_depth is None else max_depth
    visibility = jnp.broadcast_to(jnp.eye(num_rows, dtype=bool), (parents.shape[0], num_rows, num_rows))
    jump = parents  # after step s: visibility covers distances < 2**s, jump = 2**s-th ancestor
    for _ in range(max_depth.bit_length()):
        has_jump = jump >= 0
        safe_jump = jnp.where(has_jump, jump, 0)
        rows = jnp.take_along_axis(visibility, safe_jump[:, :, None], axis=1)
        visibility = visibility | (rows & has_jump[:, :, None])
        jump = jnp.where(has_jump, jnp.take_along_axis(jump, safe_jump, axis=1), -1)
    return visibility
