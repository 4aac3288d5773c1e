"""Choosing the tree budget each step: expected accept length per budget from one build, the choice, calibration.

E[tau] per budget from ONE build: the best-first pop order does not depend on the budget, so the budget-B tree
is the first B nodes of the build at the largest budget (tested against tree_build_reference and k26jax.ddtree,
ties included). Under the drafter's own probabilities E[tau](B) = 1 + sum_a S_a(B), S_a(B) the path probability
of the depth-a nodes among the first B (prefix sums; `calibrate` maps S_a when the drafter is miscalibrated).
`choose_budget` (jnp) / `choose_budget_host` (numpy) maximise sum_c E[tau_c](B) / t_step(B);
`choose_budget_per_sequence` for a cost additive over sequences. The step cost t_step comes from measured step
times (k26jax.autobudget, what `budget="auto"` uses) or from the fitted roofline model of k26jax.step_cost.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from k26jax import ops

CANDIDATES = (("chain", 7), ("ddtree", 8), ("ddtree", 16), ("ddtree", 32), ("ddtree", 64), ("ddtree", 128))


# ---- expected accept length from one tree build --------------------------------------------------------------
def node_logq(tokens_CB, depths_CB, logq_CLK, ids_CLK):
    """Each node's own log q: logq at its depth for its token [C, B] float32 (-inf on padding)."""
    C, L, _ = logq_CLK.shape
    d = jnp.clip(depths_CB - 1, 0, L - 1)
    c = jnp.arange(C)[:, None]
    hit = ids_CLK[c, d] == tokens_CB[..., None]  # [C, B, K]
    own = jnp.max(jnp.where(hit, logq_CLK[c, d], -jnp.inf), axis=-1)
    return jnp.where(depths_CB > 0, own, -jnp.inf)


def path_logq(tokens_CB, depths_CB, parents_CB1, logq_CLK, ids_CLK):
    """Log-probability of each node's whole path under the drafter, [C, B] float32 (-inf on padding)."""
    own = node_logq(tokens_CB, depths_CB, logq_CLK, ids_CLK)
    safe = jnp.where(depths_CB > 0, own, 0.0)
    total, up = safe, parents_CB1[:, 1:]  # up: node index of the current ancestor (0 = root)
    for _ in range(logq_CLK.shape[1] - 1):
        total = total + jnp.where(up > 0, jnp.take_along_axis(safe, jnp.maximum(up - 1, 0), axis=1), 0.0)
        up = jnp.where(up > 0, jnp.take_along_axis(parents_CB1, up, axis=1), 0)
    return jnp.where(depths_CB > 0, total, -jnp.inf)


def expected_accept(path_logq_CB):
    """E[tau] of the budget-b prefix tree for b = 0..B, [C, B+1] (calibrated drafter)."""
    mass = jnp.exp(path_logq_CB)
    return 1 + jnp.concatenate([jnp.zeros_like(mass[:, :1]), jnp.cumsum(mass, axis=1)], axis=1)


def survival(path_logq_CB, depths_CB, budgets, max_depth: int):
    """S [C, nB, L]: per candidate budget, the path mass of depth-a nodes among the first B nodes
    (= P(tau >= a + 1) for a calibrated drafter). budgets: static ints, each <= B."""
    mass = jnp.exp(path_logq_CB)[..., None] * (depths_CB[..., None] == jnp.arange(1, max_depth + 1))
    cum = jnp.concatenate([jnp.zeros_like(mass[:, :1]), jnp.cumsum(mass, axis=1)], axis=1)  # [C, B+1, L]
    return cum[:, jnp.asarray(budgets, jnp.int32)]


def chain_survival(logq_CLK):
    """S [C, L] of the chain (top-1 per depth): the running product of the top-1 probabilities."""
    return jnp.exp(jnp.cumsum(logq_CLK[:, :, 0], axis=1))


class Candidates(NamedTuple):
    """What `candidate_taus` returns: per-candidate E[tau] [C, nB], survival S [C, nB, L], the tree of the
    largest budget (tokens, depths, parents, num_nodes), whose prefixes are the smaller budgets' trees, and the
    draft's most likely token per depth [C, L] (the chain's)."""

    tau: jax.Array
    survival: jax.Array
    tree: tuple
    top1: jax.Array


def candidate_taus(draft_logits_CLV, candidates=CANDIDATES, *, impls: ops.Impls, calibration=None) -> Candidates:
    """E[tau] of every candidate ("ar", "chain", ("ddtree", B)) from one top-K and one best-first build at the
    largest DDTree budget (traceable: the in-step estimate)."""
    C, L, V = draft_logits_CLV.shape
    b_max = max([b for m, b in candidates if m == "ddtree"], default=1)
    logq, ids = ops.draft_topk(draft_logits_CLV, min(b_max, V))
    tree = ops.tree_build(logq, ids, jnp.full((C,), b_max, jnp.int32), max_budget=b_max, impls=impls)
    tokens, depths, parents, _ = tree
    budgets = [b if m == "ddtree" else 0 for m, b in candidates]
    s = survival(path_logq(tokens, depths, parents, logq, ids), depths, budgets, L)
    is_chain = jnp.asarray([m == "chain" for m, _ in candidates])[None, :, None]
    s = jnp.where(is_chain, chain_survival(logq)[:, None], s)
    s = jnp.where(jnp.asarray([m == "ar" for m, _ in candidates])[None, :, None], 0.0, s)
    g = calibration or Calibration()
    return Candidates(1 + g(s).sum(-1), s, tree, ids[..., 0])


def prefix_tree(tree, budget: int):
    """The budget-B tree as the first B nodes of a larger build (tokens, depths, parents, num_nodes)."""
    tokens, depths, parents, num_nodes = tree
    return tokens[:, :budget], depths[:, :budget], parents[:, : budget + 1], jnp.minimum(num_nodes, budget)


# ---- the choice ------------------------------------------------------------------------------------------------
def _batch_choice(xp, tau_CB, cost_B, active_C):
    rate = (tau_CB * active_C[:, None]).sum(0) / cost_B
    return xp.argmax(rate)


def choose_budget(tau_CB, cost_B, active_C=None):
    """Index of the candidate maximising sum_c E[tau_c] / t_step (jnp; inactive slots count 0)."""
    active = jnp.ones(tau_CB.shape[0]) if active_C is None else active_C.astype(tau_CB.dtype)
    return _batch_choice(jnp, tau_CB, cost_B, active).astype(jnp.int32)


def choose_budget_host(tau_CB, cost_B, active_C=None) -> int:
    """numpy twin of `choose_budget`."""
    tau = np.asarray(tau_CB, np.float64)
    active = np.ones(tau.shape[0]) if active_C is None else np.asarray(active_C, np.float64)
    return int(_batch_choice(np, tau, np.asarray(cost_B, np.float64), active))


def choose_budget_per_sequence(tau_CB, fixed_cost, per_sequence_cost_B, iters: int = 8):
    """Per-sequence candidate indices [C] maximising sum_c tau_c(b_c) / (fixed + sum_c cost(b_c)) (Dinkelbach:
    for the current rate r each sequence maximises tau - r * cost on its own; r <- the new ratio). Needs a step
    whose cost is additive over sequences (ragged verify); jnp."""
    tau = jnp.asarray(tau_CB, jnp.float32)
    cost = jnp.asarray(per_sequence_cost_B, jnp.float32)

    def body(_, r):
        pick = jnp.argmax(tau - r * cost[None], axis=1)
        return jnp.take_along_axis(tau, pick[:, None], 1).sum() / (fixed_cost + cost[pick].sum())

    r = jax.lax.fori_loop(0, iters, body, jnp.float32(0.0))
    return jnp.argmax(tau - r * cost[None], axis=1).astype(jnp.int32)


# ---- calibration ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Calibration:
    """A monotone map g of the predicted P(tau >= a + 1) = S_a (identity by default): "power" g(s) = s^gamma
    (gamma > 1: the drafter is overconfident), "isotonic" piecewise linear through knots (xs, ys). Hashable."""

    kind: str = "identity"
    gamma: float = 1.0
    xs: tuple = ()
    ys: tuple = ()

    def __call__(self, s):
        if self.kind == "identity":
            return s
        if self.kind == "power":
            return jnp.power(jnp.clip(s, 0.0, 1.0), self.gamma)
        return jnp.interp(s, jnp.asarray(self.xs, jnp.float32), jnp.asarray(self.ys, jnp.float32))


def calibration_pairs(survival_CL, accept_len_C):
    """(predicted S_a, observed 1[tau >= a + 1]) for a = 1..L of each sequence of one step, flattened (numpy):
    what the host collects from each step's stats (the survival of the tree actually verified)."""
    s = np.asarray(survival_CL, np.float64)
    a = np.arange(1, s.shape[1] + 1)[None]
    return s.ravel(), (np.asarray(accept_len_C)[:, None] >= a + 1).astype(np.float64).ravel()


def _pava(y, w):
    """Pool-adjacent-violators: the non-decreasing least-squares fit of y with weights w."""
    blocks = []  # [value, weight, count]
    for yi, wi in zip(y, w):
        blocks.append([yi, wi, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.concatenate([[v] * n for v, _, n in blocks])


def calibrate(predicted, observed, kind: str = "power", bins: int = 64) -> Calibration:
    """Fit g so that g(S_a) matches the observed frequency of tau >= a + 1.

    predicted: S_a values (the drafter's own P(tau >= a + 1) for the verified tree), observed: 0/1 outcomes
    (`calibration_pairs` over many steps). "power": gamma by maximum Bernoulli likelihood (golden section on
    log gamma in [-3, 3] to 1e-6, one likelihood a bracket), a temperature on path probabilities: for a chain
    S_a^gamma is exactly the product of the top-1 probabilities each raised to gamma. "isotonic":
    pool-adjacent-violators over the outcomes sorted by S, averaged into `bins` quantile knots (plus (0, 0) and
    (1, 1) ends), then interpolated."""
    s = np.clip(np.asarray(predicted, np.float64), 1e-9, 1.0)
    y = np.asarray(observed, np.float64)
    if s.shape != y.shape or s.size == 0:
        raise ValueError(f"predicted {s.shape} and observed {y.shape} must be equal non-empty shapes")
    if kind == "power":
        log_s = np.log(s)

        def nll(log_gamma):
            p = np.clip(np.exp(np.exp(log_gamma) * log_s), 1e-9, 1 - 1e-9)
            return -(y * np.log(p) + (1 - y) * np.log1p(-p)).sum()

        r = (np.sqrt(5.0) - 1) / 2  # each bracket keeps one of the last two points
        lo, hi = -3.0, 3.0
        a, b = hi - r * (hi - lo), lo + r * (hi - lo)
        fa, fb = nll(a), nll(b)
        while hi - lo > 1e-6:
            if fa < fb:
                hi, b, fb = b, a, fa
                a = hi - r * (hi - lo)
                fa = nll(a)
            else:
                lo, a, fa = a, b, fb
                b = lo + r * (hi - lo)
                fb = nll(b)
        return Calibration("power", gamma=float(np.exp((lo + hi) / 2)))
    if kind == "isotonic":
        order = np.argsort(s, kind="stable")
        fit = _pava(y[order], np.ones(s.size))
        edges = np.linspace(0, s.size, min(bins, s.size) + 1).astype(int)
        xs = [s[order][i:j].mean() for i, j in zip(edges[:-1], edges[1:]) if j > i]
        ys = [fit[i:j].mean() for i, j in zip(edges[:-1], edges[1:]) if j > i]
        xs, ys = [0.0] + xs + [1.0], [0.0] + ys + [1.0]
        return Calibration(
            "isotonic", xs=tuple(float(x) for x in xs), ys=tuple(float(v) for v in np.maximum.accumulate(ys))
        )
    raise ValueError(f"kind={kind!r}: use 'power' or 'isotonic'")
