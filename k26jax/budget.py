"""Choosing the tree budget each step: expected accept length per budget, a step cost model, the choice.

E[tau] per budget from ONE build: the best-first pop order does not depend on the budget, so the budget-B tree
is the first B nodes of the build at the largest budget (tested against tree_build_reference and k26jax.ddtree,
ties included). Under the drafter's own probabilities E[tau](B) = 1 + sum_a S_a(B), S_a(B) the path probability
of the depth-a nodes among the first B (prefix sums; `calibrate` maps S_a when the drafter is miscalibrated).
`StepCost`: a linear model over roofline terms (weights, touched routed experts, latent-cache attention bytes and
FLOPs, drafter, per-layer latency floors, tree build; collectives explicit), fitted on bench_e2e records; one GPU
at depth N or the 61-layer n-GPU step. `choose_budget` (jnp) / `choose_budget_host` (numpy) maximise
sum_c E[tau_c](B) / t_step(B); `choose_budget_per_sequence` for a cost additive over sequences.

Where the choice can run: in the step (lax.switch over the candidates' verify widths; on a GPU an XLA conditional
reads its branch index on the host, a sync), one step late on the host (the step returns `candidate_taus(...).tau`
[C, nB] and the host runs the chosen budget's executable: no sync, the estimate one step stale), or per sequence
through tree_build's per-sequence budgets (pays only once padded nodes are skipped). Not yet wired into the engine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from k26jax import ops, sharding
from k26jax.config import DrafterConfig, ModelConfig, build_target_layer_ids, preset
from k26jax.model import drafter as drafter_lib
from k26jax.model import target

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
    """What `candidate_taus` returns: per-candidate E[tau] [C, nB], survival S [C, nB, L] and the tree of the
    largest budget (tokens, depths, parents, num_nodes), whose prefixes are the smaller budgets' trees."""

    tau: jax.Array
    survival: jax.Array
    tree: tuple


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
    return Candidates(1 + g(s).sum(-1), s, tree)


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
    log gamma in [-3, 3]), a temperature on path probabilities: for a chain S_a^gamma is exactly the product of
    the top-1 probabilities each raised to gamma. "isotonic": pool-adjacent-violators over the outcomes sorted by
    S, averaged into `bins` quantile knots (plus (0, 0) and (1, 1) ends), then interpolated."""
    s = np.clip(np.asarray(predicted, np.float64), 1e-9, 1.0)
    y = np.asarray(observed, np.float64)
    if s.shape != y.shape or s.size == 0:
        raise ValueError(f"predicted {s.shape} and observed {y.shape} must be equal non-empty shapes")
    if kind == "power":

        def nll(log_gamma):
            p = np.clip(s ** np.exp(log_gamma), 1e-9, 1 - 1e-9)
            return -(y * np.log(p) + (1 - y) * np.log1p(-p)).sum()

        lo, hi = -3.0, 3.0
        for _ in range(60):
            a, b = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
            lo, hi = (lo, b) if nll(a) < nll(b) else (a, hi)
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


# ---- the step cost model ------------------------------------------------------------------------------------------
def kimi_drafter_config(cfg: ModelConfig, tiny: bool = False) -> DrafterConfig:
    """The DFlash drafter at Kimi dims (6 layers, 64 / 8 heads, block 8; GGUF metadata), or with tiny=True a 2-layer
    one at cfg's width that shards 8 ways; target layers clamped to cfg's depth (the benchmarks' drafter)."""
    dims = dict(
        hidden_size=7168,
        num_hidden_layers=6,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=18432,
        num_target_layers=61,
    )
    if tiny:
        dims.update(
            hidden_size=cfg.hidden_size,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=32,
            intermediate_size=512,
            num_target_layers=4,
        )
    ids = [
        min(i, cfg.num_hidden_layers - 1)
        for i in build_target_layer_ids(dims["num_target_layers"], dims["num_hidden_layers"])
    ]
    return DrafterConfig.from_dict(
        dict(
            dims,
            rope_theta=50000.0,
            rms_norm_eps=1e-6,
            block_size=8,
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.max_position_embeddings,
            dflash_config=dict(target_layer_ids=ids, mask_token_id=cfg.vocab_size - 2),
        )
    )


@dataclasses.dataclass(frozen=True)
class Machine:
    """Rates (one GPU's measured ceilings), GPU count and expert layout, collective model (ring all-reduce:
    latency + 2 (n-1)/n bytes / bus bandwidth)."""

    copy_tbps: float = 4.0
    matmul_tflops: float = 620.0
    gpus: int = 1
    expert_mode: str = "ep"
    collective_us: float = 10.0
    busbw_gbps: float = 360.0

    def __post_init__(self):
        if self.expert_mode not in ("ep", "tp"):  # one host: the cost of "ep_global" is in docs/MULTIHOST.md
            raise ValueError(f"Machine.expert_mode={self.expert_mode!r}: the step cost model covers 'ep' and 'tp'")


@functools.lru_cache(maxsize=4096)
def experts_touched(tokens: int, num_experts: int, top_k: int, shards: int = 1, skew: float = 0.0):
    """(expected distinct experts touched by `tokens` tokens, expected count on the busiest of `shards` equal
    expert shards).

    Each token includes expert e with probability rho_e = min(1, c pi_e), sum_e rho_e = top_k, independently
    across tokens, where pi_e ~ (e + 1)^-skew is the router's popularity law: skew 0 is balanced routing (the
    worst case, rho_e = k / E), skew > 0 a router that concentrates (a random untrained one). The busiest shard
    is the max of `shards` iid Binomial(E / shards, P(touched)) for balanced routing, scaled by the mean ratio
    for a skewed one."""
    pi = (np.arange(num_experts) + 1.0) ** -skew
    pi /= pi.sum()
    lo, hi = 0.0, float(num_experts) / pi.min()
    for _ in range(100):  # water-filling: sum_e min(1, c pi_e) = top_k
        c = (lo + hi) / 2
        lo, hi = (c, hi) if np.minimum(1, c * pi).sum() < top_k else (lo, c)
    rho = np.minimum(1, (lo + hi) / 2 * pi)
    total = float(np.sum(1 - (1 - rho) ** tokens))
    if shards == 1:
        return total, total
    m = num_experts // shards
    p = 1 - (1 - top_k / num_experts) ** tokens
    k = np.arange(m + 1)
    pmf = np.array([math.comb(m, int(i)) for i in k], np.float64) * p**k * (1 - p) ** (m - k)
    worst = float(np.sum(1 - np.cumsum(pmf)[:-1] ** shards))  # E[max] = sum_j P(max > j)
    return total, worst * total / (num_experts * p)


@functools.lru_cache(maxsize=64)
def weight_parts(cfg: ModelConfig, dcfg: DrafterConfig, n: int, expert_mode: str, dtype=jnp.bfloat16) -> dict:
    """Per-GPU {part: (bytes, elements)} of the weights split over n GPUs as k26jax.sharding says; routed experts
    as a whole (a step's touched share is applied by its caller)."""

    def per_gpu(tree, specs):
        out = {}
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        for (path, leaf), spec in zip(flat, jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))):
            div = np.prod([n if a == sharding.MODEL and dim % n == 0 else 1 for dim, a in zip(leaf.shape, spec)])
            elems = int(np.prod(leaf.shape)) // int(div)
            out[jax.tree_util.keystr(path)] = (elems * jnp.dtype(leaf.dtype).itemsize, elems)
        return out

    parts = {}
    leaves = per_gpu(target.abstract_params(cfg, dtype), sharding.param_partition_specs(cfg, expert_mode))
    for path, (b, e) in leaves.items():
        if "w13" in path or "w2" in path:
            part = "routed"
        elif "router" in path:
            part = "router"
        elif "shared" in path:
            part = "shared"
        elif "['mlp']" in path:
            part = "dense_mlp"
        elif path in ("['embed']", "['lm_head']"):
            part = path[2:-2]
        else:
            part = "attention"
        pb, pe = parts.get(part, (0, 0))
        parts[part] = (pb + b, pe + e)
    dleaves = per_gpu(drafter_lib.abstract_params(dcfg, dtype), drafter_lib.drafter_partition_specs(dcfg, n))
    parts["drafter_fc"] = dleaves["['fc']"]
    parts["drafter"] = tuple(sum(v[i] for k, v in dleaves.items() if k != "['fc']") for i in (0, 1))
    return parts


def step_tokens(method: str, budget: int, block_size: int = 8) -> int:
    """Tokens a sequence verifies per step: root + tree nodes."""
    return 1 + {"ar": 0, "chain": block_size - 1, "ddtree": budget}[method]


def step_parts(cfg, dcfg, method, budget, C, context, machine=Machine(), skew=0.0, touched=None) -> dict:
    """Per-GPU {part: (bytes, FLOPs)} of one step (the accounting of scripts/bench_e2e.py's floors).

    Routed experts: the distinct experts the step's tokens touch per MoE layer under the router's popularity
    `skew` (`experts_touched`; 0: balanced routing, the worst case), or `touched` (distinct experts per MoE layer,
    measured) when given; on EP GPUs the busiest shard's share."""
    n, item = machine.gpus, 2
    L = 0 if method == "ar" else dcfg.block_size - 1
    tokens = C * step_tokens(method, budget, dcfg.block_size)
    w = weight_parts(cfg, dcfg, n, machine.expert_mode)
    out = {p: (w[p][0], 2 * w[p][1] * tokens) for p in ("attention", "dense_mlp", "shared", "router") if p in w}
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if E:
        total, worst = experts_touched(tokens, E, k, n if machine.expert_mode == "ep" else 1, skew)
        if touched is not None:
            total, worst = touched, worst * touched / total
        share = total / E if machine.expert_mode == "tp" or n == 1 else worst * n / E
        out["routed"] = (w["routed"][0] * share, 6 * cfg.hidden_size * cfg.moe_intermediate_size * k * tokens / n)
    out["embed"] = (tokens * cfg.hidden_size * item, 0)
    out["lm_head"] = (w["lm_head"][0], 2 * w["lm_head"][1] * tokens)
    heads = cfg.num_attention_heads // n if cfg.num_attention_heads % n == 0 else cfg.num_attention_heads
    layers = cfg.num_hidden_layers
    out["kv_cache"] = (
        layers * C * context * cfg.latent_dim * item,
        layers * 2 * tokens * heads * context * (cfg.latent_dim + cfg.kv_lora_rank),
    )
    if L:
        block = dcfg.block_size
        out["draft_lm_head"] = (w["lm_head"][0], 2 * w["lm_head"][1] * C * L)
        out["drafter"] = (
            w["drafter"][0] + w["drafter_fc"][0],
            2 * w["drafter"][1] * C * block + 2 * w["drafter_fc"][1] * C * (L + 1),
        )
        split = n if dcfg.num_attention_heads % n == 0 and dcfg.num_key_value_heads % n == 0 else 1
        kv, q = dcfg.num_key_value_heads // split, dcfg.num_attention_heads // split
        out["drafter_ctx"] = (
            dcfg.num_hidden_layers * C * context * kv * dcfg.head_dim * 2 * item,
            dcfg.num_hidden_layers * 4 * C * block * q * context * dcfg.head_dim,
        )
    return out


def collective_ms(cfg, dcfg, method, budget, C, machine=Machine()) -> float:
    """All-reduces of one step on machine.gpus GPUs (bench_e2e's list: per layer attention output, dense MLP,
    routed f32 psum and shared expert; embedding; drafter), ring model. 0 on one GPU."""
    n = machine.gpus
    if n == 1:
        return 0.0
    L = 0 if method == "ar" else dcfg.block_size - 1
    tokens, D = C * step_tokens(method, budget, dcfg.block_size), cfg.hidden_size
    ops_list = [
        (cfg.num_hidden_layers + cfg.num_dense_layers + 1, tokens * D * 2),
        (cfg.num_moe_layers, tokens * D * 4),
        (cfg.num_moe_layers, tokens * D * 2),
        (1, tokens * 8),
    ]
    if L:
        K = 1 if method == "chain" else budget
        block = dcfg.block_size
        ops_list += [
            (1 + 2 * dcfg.num_hidden_layers, C * block * D * 2),
            (1, C * (L + 1) * D * 2),
            (1, C * L * K * 8 * n),
        ]
    return sum(c * (machine.collective_us * 1e-3 + 2 * (n - 1) / n * b / machine.busbw_gbps / 1e6) for c, b in ops_list)


# Terms of the linear model: feature (ms at the machine's ceilings) -> coefficient (1 = at the ceiling rate).
# fixed: ms a step; layers, attn_layers, moe_layers: ms a layer (launch and latency floors of every layer, of its
# attention kernels, of its MoE kernels); the others: bytes over the copy rate or FLOPs over the matmul rate.
TERMS = (
    "fixed", "layers", "attn_layers", "moe_layers", "weights", "weight_flops", "moe", "moe_flops", "kv",
    "attn_flops", "drafter", "build",
)  # fmt: skip
PRIOR = dict(
    fixed=0.3, layers=0.02, attn_layers=0.02, moe_layers=0.02, weights=1.2, weight_flops=1.5, moe=1.2,
    moe_flops=1.5, kv=1.2, attn_flops=1.5, drafter=1.2, build=1.0,
)  # fmt: skip
# How far a term may move from its prior at unit ridge cost (fixed and per-layer overheads: in ms).
PRIOR_SCALE = dict(PRIOR, fixed=1.0, layers=0.05, attn_layers=0.05, moe_layers=0.05)
# Tree build (top-K over the vocab + best-first pops), ms: base, per million top-K input elements, per pop.
BUILD_PRIOR = (0.2, 0.12, 6e-4)
_GROUPS = dict(
    weights=("attention", "dense_mlp", "shared", "router", "embed", "lm_head"),
    moe=("routed",),
    kv=("kv_cache",),
    drafter=("draft_lm_head", "drafter", "drafter_ctx"),
)


def build_ms(method, budget, C, vocab, block_size=8, build=BUILD_PRIOR) -> float:
    """Modelled top-K + tree build time (0 for AR; the chain pops L nodes at K = 1)."""
    if method == "ar":
        return 0.0
    L = block_size - 1
    pops = L if method == "chain" else budget
    return build[0] + build[1] * C * L * vocab / 1e6 + build[2] * pops


def features(
    cfg, dcfg, method, budget, C, context, machine=Machine(), skip=(), skew=0.0, build=BUILD_PRIOR, touched=None
):
    """{term: ms} of one step at the machine's ceilings (coefficient 1 each). skip: phases a benchmark ablation
    took out ("moe", "attention", "draft")."""
    parts = step_parts(cfg, dcfg, method, budget, C, context, machine, skew, touched)
    bw, fl = machine.copy_tbps * 1e9, machine.matmul_tflops * 1e9
    f = {t: 0.0 for t in TERMS}
    f["fixed"], f["layers"] = 1.0, float(cfg.num_hidden_layers)
    f["attn_layers"], f["moe_layers"] = float(cfg.num_hidden_layers), float(cfg.num_moe_layers)
    for g, names in _GROUPS.items():
        f[g] = sum(parts[p][0] for p in names if p in parts) / bw
    f["weight_flops"] = sum(parts[p][1] for p in _GROUPS["weights"] if p in parts) / fl
    f["drafter"] += sum(parts[p][1] for p in _GROUPS["drafter"] if p in parts) / fl
    f["moe_flops"] = parts.get("routed", (0, 0))[1] / fl
    f["attn_flops"] = parts["kv_cache"][1] / fl
    f["build"] = build_ms(method, budget, C, cfg.vocab_size, dcfg.block_size, build)
    phases = dict(moe=("moe", "moe_flops", "moe_layers"), attention=("kv", "attn_flops", "attn_layers"))
    for phase, terms in dict(phases, draft=("drafter",)).items():
        if phase in skip:
            for t in terms:
                f[t] = 0.0
    return f


@dataclasses.dataclass(frozen=True)
class StepCost:
    """t_step = sum_term coef * feature (ms) + collectives (explicit, not fitted). Hashable.

    skew: the router's expert popularity law (`experts_touched`; 0: balanced). Records made with random weights
    need their own (fitted); balanced-router rows and the projection use 0."""

    coef: tuple = tuple(PRIOR.items())
    build: tuple = BUILD_PRIOR
    skew: float = 0.0

    def terms(self, cfg, dcfg, method, budget, C, context, machine=Machine(), skip=(), touched=None) -> dict:
        """{term: ms} of one step, plus "collectives" (touched: measured distinct experts per MoE layer)."""
        f = features(cfg, dcfg, method, budget, C, context, machine, skip, self.skew, self.build, touched)
        out = {t: c * f[t] for t, c in self.coef}
        out["collectives"] = collective_ms(cfg, dcfg, method, budget, C, machine)
        return out

    def t_step(self, cfg, dcfg, method, budget, C, context, machine=Machine(), skip=(), touched=None) -> float:
        """Predicted step time, ms (one GPU at cfg's depth, or per GPU of machine.gpus for the projection)."""
        return sum(self.terms(cfg, dcfg, method, budget, C, context, machine, skip, touched).values())

    def table(self, cfg, dcfg, candidates, C, context, machine=Machine()) -> np.ndarray:
        """Step time (ms) per candidate [nB]: the cost vector `choose_budget` divides by."""
        return np.array([self.t_step(cfg, dcfg, m, b, C, context, machine) for m, b in candidates])


# ---- fitting the cost model on benchmark records -------------------------------------------------------------
ABLATIONS = {"no_moe": "moe", "no_attention": "attention", "no_draft": "draft"}


def record_rows(records) -> list[dict]:
    """Measured step rows of bench_e2e records (K2.6 width) as fit inputs: {layers, method, B, C, context, skip,
    step_ms, machine, builds, record, touched}. Read from each row: variant, layers, method, B, C, context,
    step_ms and, when the record has it, experts_touched (mean distinct experts per MoE layer); from the record:
    ceilings (copy_TBps, matmul_bf16_TFLOPs) and its build rows. XLA-default ablations ("no_options") are left
    out: another program."""
    rows = []
    for index, rec in enumerate(records):
        if rec.get("args", {}).get("preset", "k26") != "k26":
            continue
        ceil = rec.get("ceilings", {})
        machine = Machine(ceil.get("copy_TBps", 4.0), ceil.get("matmul_bf16_TFLOPs", 620.0))
        builds = [r for r in rec["rows"] if r.get("kind") == "build" and "build_ms" in r]
        for r in rec["rows"]:
            if r.get("kind") != "step" or "step_ms" not in r or "no_options" in r["variant"]:
                continue
            skip = tuple(ABLATIONS[s] for s in r["variant"].split("-")[1:] if s in ABLATIONS)
            rows.append(
                dict(
                    layers=r["layers"], method=r["method"], B=r["B"], C=r["C"], context=r["context"],
                    skip=skip, step_ms=r["step_ms"], machine=machine, builds=builds, record=index,
                    touched=r.get("experts_touched"),
                )
            )  # fmt: skip
    return rows


def fit_build(builds, vocab: int = 163840, block_size: int = 8) -> tuple:
    """(base, per M top-K elements, per pop) from build rows: least squares on base and the top-K slope when
    two or more batch sizes were measured, the per-pop prior kept (one budget cannot separate it)."""
    pts = [(r["C"] * (block_size - 1) * vocab / 1e6, r["build_ms"] - BUILD_PRIOR[2] * r["B"]) for r in builds]
    if len({x for x, _ in pts}) < 2:
        return BUILD_PRIOR
    x, y = np.array(pts).T
    slope, base = np.polyfit(x, y, 1)
    return (float(max(base, 0.0)), float(max(slope, 0.0)), BUILD_PRIOR[2])


def _config(layers: int):
    cfg = preset(f"k26-depth{layers}")
    return cfg, kimi_drafter_config(cfg)


def _fit_coef(rows, build, skew, ridge, terms):
    X, y = [], []
    for r in rows:
        cfg, dcfg = _config(r["layers"])
        args = (r["method"], r["B"], r["C"], r["context"], r["machine"], r["skip"], skew, build, r.get("touched"))
        f = features(cfg, dcfg, *args)
        X.append([f[t] for t in terms])
        y.append(r["step_ms"])
    X = np.array(X) / np.array(y)[:, None]
    prior = np.array([PRIOR[t] for t in terms])
    scale = np.array([PRIOR_SCALE[t] for t in terms])
    A = np.vstack([X, np.sqrt(ridge) * np.diag(1 / scale)])
    b = np.concatenate([np.ones(len(y)), np.sqrt(ridge) * prior / scale])
    free, coef = np.ones(len(terms), bool), np.zeros(len(terms))
    for _ in range(len(terms)):  # active set: drop negative coefficients and solve again
        coef[:] = 0
        coef[free] = np.linalg.lstsq(A[:, free], b, rcond=None)[0]
        if (coef >= 0).all():
            break
        free &= coef > 0
    loss = float(np.sum((A @ coef - b) ** 2))
    return coef, loss


def fit(rows, ridge: float = 0.2, terms=TERMS, skews=None) -> StepCost:
    """Coefficients minimising the squared relative error of every row plus
    ridge * sum ((c - prior) / scale)^2, all >= 0 (active set). The ridge holds what the rows cannot separate
    (one depth: fixed against per-layer overhead) at its prior. The build model comes from the records' build
    rows. The router's `skew` is searched over `skews` (default 0 .. 2 by 0.1: the records' random routers touch
    fewer experts than a balanced one); pass skews=(0.0,) for balanced-router rows."""
    builds = [b for r in rows for b in r["builds"]]
    build = fit_build(list({id(b): b for b in builds}.values()))
    skews = np.round(np.arange(0, 2.01, 0.1), 2) if skews is None else skews
    (coef, _), skew = min(((_fit_coef(rows, build, k, ridge, terms), k) for k in skews), key=lambda t: t[0][1])
    full = dict(PRIOR, **{t: 0.0 for t in PRIOR if t not in terms})
    full.update({t: float(c) for t, c in zip(terms, coef)})
    return StepCost(tuple(full.items()), build, float(skew))


def predict(cost: StepCost, row) -> float:
    cfg, dcfg = _config(row["layers"])
    args = (row["method"], row["B"], row["C"], row["context"], row["machine"], row["skip"], row.get("touched"))
    return cost.t_step(cfg, dcfg, *args)


def holdout(rows, **fit_args) -> list[dict]:
    """Leave one cell out (all rows of one (layers, method, B, C, context, skip)): fit on the rest, predict it.
    Returns per row {cell, measured, predicted, rel_err}."""
    cell = lambda r: (r["layers"], r["method"], r["B"], r["C"], r["context"], r["skip"])  # noqa: E731
    out = []
    for key in sorted({cell(r) for r in rows}, key=str):
        model = fit([r for r in rows if cell(r) != key], **fit_args)
        for r in rows:
            if cell(r) == key:
                p = predict(model, r)
                out.append(dict(cell=key, measured=r["step_ms"], predicted=p, rel_err=p / r["step_ms"] - 1))
    return out
