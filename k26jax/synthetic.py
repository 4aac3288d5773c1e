"""A calibrated synthetic drafter: controlled acceptance under which AR, chain and every DDTree budget earn the
accept length their trees really earn, under one stated assumption.

Each step, sequence c and depth d get a draft distribution q over the vocabulary from a `Profile`:
  * the top-1 token has probability p = sigmoid(level - slope * (d - 1) + spread * eps), eps ~ N(0, 1) drawn once
    per sequence and step (an easy step is easy at every depth, so confidence varies from step to step);
  * the remaining 1 - p follows a Zipf law over ranks r = 1 .. V-1: q_r = (1 - p) r^-tail / sum_r' r'^-tail;
  * rank r is token (offset + r) mod V, offset uniform per (sequence, depth): a rotation of the vocabulary.
The "target" token at depth d is drawn from that same q, independently per depth: the drafter is calibrated by
construction, and a tree's expected accept length is 1 + the sum over its nodes of the product of q along the
node's path (DDTree's own objective, which is why this model flatters trees).

`SyntheticDraft` (an engine Drafter) returns log q; `CalibratedAccept` (an engine Acceptor) redraws the same
p, offsets and the target's tokens from the same key (seed, step), turns them into per-node target choices and
runs the real `ops.tree_accept` on the tree the step built, so path / accept_len / bonus are exactly its format.
Depth-L nodes keep the real target's choice (the synthetic target has no token past depth L).

`expected_tau` gives E[tau] of AR, chain and DDTree at any budget for a profile (Gauss-Hermite over eps, the
best-first tree per node); `fit_profile` picks `level` so that the chain's E[tau] at block size b is a target
(5.3 at b = 8: Kimi-K2.5 DFlash's figure), and optionally `tail` to match a measured tree tau as well.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from k26jax import ddtree, engine, ops

EXACT_RANKS = 4096  # ranks sampled exactly by the target: > tree_build's MAX_BUDGET, so every tree rank is exact
QUADRATURE_NODES = 24


@dataclasses.dataclass(frozen=True)
class Profile:
    """Per-depth draft distributions (module docstring). Hashable: part of the compiled step's identity."""

    vocab: int
    level: float = 2.0
    slope: float = 0.15
    spread: float = 1.0
    tail: float = 1.5

    def __post_init__(self):
        if self.vocab < 2:
            raise ValueError(f"vocab={self.vocab}: need >= 2")
        if self.tail <= 0 or self.spread < 0:
            raise ValueError(f"tail={self.tail}, spread={self.spread}: need tail > 0, spread >= 0")

    def top1(self, depth: int, eps=0.0):
        """p at depth d (1-based) for difficulty eps (numpy)."""
        return 1 / (1 + np.exp(-(self.level - self.slope * (depth - 1) + self.spread * np.asarray(eps))))

    def rank_probs(self, num_depths: int, k: int, eps: float = 0.0) -> np.ndarray:
        """Sorted probabilities of the k most likely tokens at each depth, [L, k] float64 (numpy)."""
        p = self.top1(np.arange(1, num_depths + 1), eps)[:, None]
        w = _tail_weights(self.vocab, self.tail)[: k - 1]
        q = np.concatenate([p, (1 - p) * w[None]], axis=1)
        return -np.sort(-q, axis=1)

    def entropy(self, num_depths: int, eps: float = 0.0) -> np.ndarray:
        """Entropy (nats) of each depth's distribution at difficulty eps, [L]."""
        p = self.top1(np.arange(1, num_depths + 1), eps)[:, None]
        w = _tail_weights(self.vocab, self.tail)
        tail_h = -(w * np.log(w)).sum()
        return (-p * np.log(p) - (1 - p) * np.log1p(-p) + (1 - p) * tail_h)[:, 0]


@functools.lru_cache(maxsize=16)
def _tail_weights(vocab: int, tail: float) -> np.ndarray:
    """Zipf weights of ranks 1 .. V-1, summing to 1 (float64)."""
    w = np.arange(1, vocab, dtype=np.float64) ** -tail
    return w / w.sum()


@functools.lru_cache(maxsize=16)
def _tail_log_norm(vocab: int, tail: float) -> float:
    return float(np.log(np.sum(np.arange(1, vocab, dtype=np.float64) ** -tail)))


@functools.lru_cache(maxsize=16)
def _tail_cdf(vocab: int, tail: float) -> np.ndarray:
    """CDF of ranks 1 .. min(V, EXACT_RANKS)-1 under the tail law (float32; the rest of the mass lies past it)."""
    return np.cumsum(_tail_weights(vocab, tail)[: min(vocab, EXACT_RANKS) - 1]).astype(np.float32)


def draws(profile: Profile, seed: int, step, C: int, L: int):
    """(top-1 probability p [C, L] float32, offset [C, L] int32, target's rank [C, L] int32) of one step.

    One key per (seed, step): the drafter and the acceptor call this with the same arguments and get the same
    draws. Target ranks past the exact table (never in a tree) are drawn uniformly over the rest of the vocab."""
    V = profile.vocab
    k_eps, k_off, k_pick, k_tail, k_far = jax.random.split(jax.random.fold_in(jax.random.key(seed), step), 5)
    eps = jax.random.normal(k_eps, (C, 1))
    d = jnp.arange(L, dtype=jnp.float32)[None]
    p = jax.nn.sigmoid(profile.level - profile.slope * d + profile.spread * eps)
    offset = jax.random.randint(k_off, (C, L), 0, V, jnp.int32)
    n_exact = min(V, EXACT_RANKS)
    u = jax.random.uniform(k_tail, (C, L))
    near = 1 + jnp.searchsorted(jnp.asarray(_tail_cdf(V, profile.tail)), u, side="right").astype(jnp.int32)
    if V > n_exact:
        tail_rank = jnp.where(near < n_exact, near, jax.random.randint(k_far, (C, L), n_exact, V, jnp.int32))
    else:
        tail_rank = jnp.minimum(near, V - 1)
    rank = jnp.where(jax.random.uniform(k_pick, (C, L)) < p, 0, tail_rank)
    return p, offset, rank


def draft_logits(profile: Profile, p_CL, offset_CL, temperature: float = 1.0):
    """log q [C, L, V] float32 (divided by `temperature`: != 1 makes a miscalibrated drafter)."""
    V = profile.vocab
    log_z = _tail_log_norm(V, profile.tail)
    v = jnp.arange(V, dtype=jnp.int32)[None, None]
    rank = jnp.mod(v - offset_CL[..., None], V)
    log_tail = jnp.log1p(-p_CL)[..., None] - profile.tail * jnp.log(jnp.maximum(rank, 1).astype(jnp.float32)) - log_z
    logq = jnp.where(rank == 0, jnp.log(p_CL)[..., None], log_tail)
    return logq / temperature


@dataclasses.dataclass(frozen=True)
class SyntheticDraft:
    """An engine Drafter: log q of the profile, fresh each step (key = seed, state.step).

    temperature != 1 sharpens (< 1) or flattens (> 1) the proposal while the target keeps sampling from the
    profile: a miscalibrated drafter. `base` (another Drafter, e.g. engine.DFlashDraft()) still runs and its
    output stays live, so a benchmark pays the real drafter's cost while acceptance follows the profile."""

    profile: Profile
    seed: int = 0
    temperature: float = 1.0
    base: object | None = None

    def propose(self, params, dparams, state, *, cfg, dcfg, sc):
        if cfg.vocab_size != self.profile.vocab:
            raise ValueError(f"profile.vocab={self.profile.vocab} but the model's vocab_size={cfg.vocab_size}")
        p, offset, _ = draws(self.profile, self.seed, state.step, state.root.shape[0], sc.depth)
        logits = draft_logits(self.profile, p, offset, self.temperature)
        if self.base is None:
            return logits
        real = self.base.propose(params, dparams, state, cfg=cfg, dcfg=dcfg, sc=sc).astype(jnp.float32)
        return jnp.where(real == jnp.inf, real, logits)  # never taken: keeps the real drafter live

    def context_kv(self, dparams, features, positions, *, dcfg):
        """The base drafter's context K/V (the DFlash drafter's without a base)."""
        return engine.context_kv(self.base, dparams, features, positions, dcfg=dcfg)


def node_depths(parents_CB1, max_depth: int):
    """Depth of every node [C, B+1] (root 0) from parents (parents[i] < i; padding -1 reads as depth 0)."""
    depth = jnp.zeros(parents_CB1.shape, jnp.int32)
    for _ in range(max_depth):
        up = jnp.take_along_axis(depth, jnp.maximum(parents_CB1, 0), axis=1)
        depth = jnp.where(parents_CB1 >= 0, up + 1, 0)
    return depth


@dataclasses.dataclass(frozen=True)
class CalibratedAccept:
    """An engine Acceptor: the target's token at depth d is drawn from the drafter's own q (same key as
    `SyntheticDraft` with this profile and seed); node i's choice is the target token at depth(i) + 1, and the
    real `ops.tree_accept` walks the step's tree with those choices."""

    profile: Profile
    seed: int = 0

    def target_tokens(self, state, C: int, L: int):
        """The target's tokens at depths 1..L, [C, L] int32."""
        _, offset, rank = draws(self.profile, self.seed, state.step, C, L)
        return jnp.mod(offset + rank, self.profile.vocab)

    def accept(self, tokens_CB, parents_CB1, post_CB1, num_nodes_C, state, *, sc, impls):
        C, L = post_CB1.shape[0], sc.depth
        true_CL = self.target_tokens(state, C, L)
        depth = node_depths(parents_CB1, L)
        choice = jnp.take_along_axis(true_CL, jnp.minimum(depth, L - 1), axis=1)
        post = jnp.where(depth < L, choice, post_CB1).astype(jnp.int32)
        return ops.tree_accept(tokens_CB, parents_CB1, post, num_nodes_C, max_depth=L, impls=impls)


def synthetic_pair(profile: Profile, seed: int = 0, *, temperature: float = 1.0, base=None):
    """(SyntheticDraft, CalibratedAccept) sharing profile and seed: pass them to engine.Decoder."""
    return SyntheticDraft(profile, seed, temperature, base), CalibratedAccept(profile, seed)


# ---- expected accept length ---------------------------------------------------------------------------------
def _quadrature():
    x, w = np.polynomial.hermite_e.hermegauss(QUADRATURE_NODES)
    return x, w / w.sum()


def tau_curve(profile: Profile, budgets, *, block_size: int = 8) -> dict:
    """E[tau] for "ar", "chain" and DDTree at each budget in `budgets` ({"ar": ., "chain": ., B: .}).

    Per quadrature node eps: the best-first tree (k26jax.ddtree) of the largest budget over the top ranks, whose
    first B nodes are the budget-B tree; E[tau | eps] = 1 + the sum of their path probabilities."""
    L = block_size - 1
    budgets = sorted({int(b) for b in budgets})
    b_max = max(budgets) if budgets else 1
    out = {"ar": 1.0, "chain": 0.0, **{b: 0.0 for b in budgets}}
    for eps, weight in zip(*_quadrature()):
        q = profile.rank_probs(L, min(max(b_max, 2), profile.vocab), eps)
        out["chain"] += weight * (1 + np.cumprod(q[:, 0]).sum())
        if not budgets:
            continue
        logq = np.log(q).astype(np.float32)
        ids = np.tile(np.arange(q.shape[1], dtype=np.int32), (L, 1))
        tree = ddtree.build_tree_from_topk(logq, ids, b_max)
        path = np.ones(tree.num_nodes + 1)
        for i in range(1, tree.num_nodes + 1):
            path[i] = path[tree.parents[i]] * q[tree.depths[i - 1] - 1, tree.tokens[i - 1]]
        cum = 1 + np.cumsum(path[1:])
        for b in budgets:
            out[b] += weight * cum[min(b, tree.num_nodes) - 1]
    return out


def expected_tau(profile: Profile, method: str, budget: int = 32, *, block_size: int = 8) -> float:
    """E[tau] of one method ("ar", "chain" or "ddtree" at `budget`) under the profile."""
    if method == "ar":
        return 1.0
    if method == "chain":
        return tau_curve(profile, (), block_size=block_size)["chain"]
    if method == "ddtree":
        return tau_curve(profile, (budget,), block_size=block_size)[budget]
    raise ValueError(f"method={method!r}: use 'ar', 'chain' or 'ddtree'")


def _bisect(f, lo: float, hi: float, iters: int = 60) -> float:
    """The root of increasing f on [lo, hi] (clamped to the ends)."""
    if f(lo) >= 0:
        return lo
    if f(hi) <= 0:
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def fit_profile(
    target_chain_tau: float = 5.3,
    block_size: int = 8,
    *,
    vocab: int = 163840,
    tree_tau: dict | None = None,
    **fixed,
) -> Profile:
    """The profile whose chain E[tau] at `block_size` is target_chain_tau: `level` by bisection, the other
    fields from `fixed` (Profile's defaults otherwise). tree_tau {budget: measured DDTree tau} (e.g. the mini
    pair's curve) also fits `tail` (heavier tail: more mass below rank 1, larger tree gains) by least squares."""
    if not 1 < target_chain_tau < block_size:
        raise ValueError(f"target_chain_tau={target_chain_tau}: must lie in (1, block_size={block_size})")

    def with_level(tail):
        base = Profile(vocab, **{**fixed, "tail": tail} if tail is not None else fixed)

        def gap(level):
            return expected_tau(dataclasses.replace(base, level=level), "chain", block_size=block_size) - (
                target_chain_tau
            )

        return dataclasses.replace(base, level=_bisect(gap, -20.0, 40.0))

    if not tree_tau:
        return with_level(None)

    def loss(tail):
        curve = tau_curve(with_level(tail), tree_tau, block_size=block_size)
        return sum((curve[b] - t) ** 2 for b, t in tree_tau.items())

    tails = np.linspace(0.6, 4.0, 18)
    best = tails[int(np.argmin([loss(t) for t in tails]))]
    lo, hi = max(0.55, best - 0.2), best + 0.2
    for _ in range(20):  # golden-section refinement
        a, b = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
        lo, hi = (lo, b) if loss(a) < loss(b) else (a, hi)
    return with_level((lo + hi) / 2)
