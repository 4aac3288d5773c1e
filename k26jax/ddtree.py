"""DDTree draft trees on the CPU (numpy + heapq): the reference and the benchmark baseline.

Best-first tree build of Ringel & Romano, "Accelerating Speculative Decoding with Block Diffusion
Draft Trees" (arXiv:2604.12989, Algorithm 1 / `build_ddtree_tree`). A node at depth d with rank tuple
(r_1 .. r_d) scores sum_d' logq[d'-1, r_d']; the B best-scoring prefixes form the optimal tree.

Rules shared bit for bit with `pallas_kernels.tree_build` (so trees match node for node, ties too):
  * K_c = min(budget, K, max_topk) candidates per depth; `logq` are float32 log-probs.
  * Scores are float32, evaluated left to right exactly as written:
        first node   logq[0, 0]
        sibling      (logw - logq[d-1, r]) + logq[d-1, r+1]          (rank r -> r+1, same parent)
        first child  (logw + logq[d, 0]) + depth_bonus               (depth d -> d+1, rank 0)
  * Candidate slots: the first node takes slot 0; pop i (0-based) puts its sibling in slot 2i+1 and its
    child in slot 2i+2. Among equal scores the lowest slot (the candidate created first) pops first.
    Without exact ties this is the paper's order (its heap breaks ties by rank tuple).
  * A candidate scoring -inf (a zero-probability token) is never pushed; the heap may run dry before B
    nodes, and the tail of every output is padded with -1.
"""

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass
class Tree:
    """A draft tree of budget B; node 0 is the root (the last emitted token), nodes 1..B in pop order.

    tokens [B] int32 token of node i+1; depths [B] int32 depth of node i+1 (1..L);
    parents [B+1] int32 (parents[0] = -1, parents[i] < i); visibility [B+1, B+1] bool (row i: node i
    and its ancestors); num_nodes: nodes built (<= B); entries past it are -1 (padded rows see only
    themselves).
    """

    tokens: np.ndarray
    depths: np.ndarray
    parents: np.ndarray
    visibility: np.ndarray
    num_nodes: int


def topk_logprobs(draft_logits, k):
    """Top-k per row with `lax.top_k`'s order (descending, equal values: lower token id first).

    draft_logits [L, V] float -> (logq [L, k'] float32 log-softmax over the full vocab, ids [L, k'] int32),
    k' = min(k, V).
    """
    logits = np.asarray(draft_logits, np.float32)
    if logits.ndim != 2 or logits.shape[0] < 1 or logits.shape[1] < 1:
        raise ValueError(f"draft_logits must be a non-empty [L, V] array, got shape {logits.shape}")
    if np.isnan(logits).any() or not np.isfinite(logits.max(axis=-1)).all():
        raise ValueError("draft_logits must not contain NaN and every row needs a finite maximum")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    num_rows, vocab = logits.shape
    k = min(k, vocab)
    kth_largest = -np.partition(-logits, k - 1, axis=-1)[:, k - 1]
    ids = np.empty((num_rows, k), np.int32)
    for row, (x, kth) in enumerate(zip(logits, kth_largest)):
        above = np.flatnonzero(x > kth)
        chosen = np.concatenate([above, np.flatnonzero(x == kth)[: k - above.size]])
        ids[row] = chosen[np.lexsort((chosen, -x[chosen]))]
    x64 = logits.astype(np.float64)
    row_max = x64.max(axis=-1, keepdims=True)
    lse = row_max + np.log(np.exp(x64 - row_max).sum(axis=-1, keepdims=True))
    logq = (np.take_along_axis(x64, ids, axis=-1) - lse).astype(np.float32)
    return logq, ids


def build_tree(draft_logits, budget, *, max_topk=None, depth_bonus=0.0):
    """Paper-exact DDTree from draft_logits [L, V] with K = min(budget, V) candidates per depth.

    `max_topk` (cap on K) and `depth_bonus` (added to every child's score) are SGLang PR #29907 knobs,
    off by default; either one makes the tree differ from the paper's optimal tree.
    """
    logq, ids = topk_logprobs(draft_logits, max(budget, 1))
    return build_tree_from_topk(logq, ids, budget, max_topk=max_topk, depth_bonus=depth_bonus)


def build_tree_from_topk(logq, ids, budget, *, max_topk=None, depth_bonus=0.0):
    """Best-first build from logq [L, K] float32 log-probs and their ids [L, K] int32 (module docstring)."""
    logq = np.asarray(logq)
    ids = np.asarray(ids)
    if logq.dtype != np.float32 or logq.ndim != 2 or logq.shape[0] < 1 or logq.shape[1] < 1:
        raise ValueError(f"logq must be a non-empty float32 [L, K] array, got {logq.dtype} {logq.shape}")
    if ids.shape != logq.shape:
        raise ValueError(f"ids must have logq's shape {logq.shape}, got {ids.shape}")
    if not isinstance(budget, (int, np.integer)) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    if max_topk is not None and max_topk < 1:
        raise ValueError(f"max_topk must be >= 1 or None, got {max_topk}")
    budget = int(budget)
    depth, k_total = logq.shape
    k = min(budget, k_total, max_topk or k_total)
    bonus = np.float32(depth_bonus)
    tokens = np.full(budget, -1, np.int32)
    depths = np.full(budget, -1, np.int32)
    parents = np.full(budget + 1, -1, np.int32)

    heap = []

    def push(score, slot, parent, d, rank):
        if score > -np.inf:
            heapq.heappush(heap, (-float(score), slot, score, parent, d, rank))

    if k > 0:
        push(logq[0, 0], 0, 0, 1, 0)
    num_nodes = 0
    while heap and num_nodes < budget:
        _, _, logw, parent, d, rank = heapq.heappop(heap)
        i = num_nodes
        tokens[i], depths[i], parents[i + 1] = ids[d - 1, rank], d, parent
        if rank + 1 < k:
            push((logw - logq[d - 1, rank]) + logq[d - 1, rank + 1], 2 * i + 1, parent, d, rank + 1)
        if d < depth:
            push((logw + logq[d, 0]) + bonus, 2 * i + 2, i + 1, d + 1, 0)
        num_nodes += 1
    return Tree(tokens, depths, parents, visibility_from_parents(parents), num_nodes)


def visibility_from_parents(parents):
    """parents [B+1] int (-1 = root or padding) -> visibility [B+1, B+1] bool: self and ancestors."""
    parents = np.asarray(parents)
    visibility = np.eye(parents.shape[0], dtype=bool)
    for i in range(1, parents.shape[0]):
        if parents[i] >= 0:
            visibility[i, :i] = visibility[parents[i], :i]
    return visibility


def follow_tree(tokens, parents, post):
    """Walk from the root along drafted children that match the target's choice.

    tokens [B], parents [B+1], post [B+1] (target's token per node, row 0 = root) ->
    (path: accepted node indices starting with 0, bonus: post at the last accepted node).
    """
    child_of = {(int(p), int(t)): i for i, (p, t) in enumerate(zip(parents[1:], tokens), start=1) if p >= 0}
    path = [0]
    while (path[-1], int(post[path[-1]])) in child_of:
        path.append(child_of[(path[-1], int(post[path[-1]]))])
    return path, int(post[path[-1]])
