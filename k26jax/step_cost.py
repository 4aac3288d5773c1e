"""The step cost model: t_step(method, B, C, context) for one GPU at depth N or the 61-layer n-GPU step.

`StepCost`: a linear model over roofline terms (weights, touched routed experts, latent-cache attention bytes and
FLOPs, drafter, per-layer latency floors, tree build; collectives explicit), fitted on bench_e2e records
(`fit`, `holdout` for its error on held-out cells). `experts_touched` counts the routed experts a step reads,
`weight_parts` the per-GPU weight bytes as k26jax.sharding splits them.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from k26jax import sharding
from k26jax.config import DrafterConfig, ModelConfig, build_target_layer_ids, preset
from k26jax.model import drafter as drafter_lib
from k26jax.model import target


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


def record_rows(records, machine: Machine | None = None) -> list[dict]:
    """Measured step rows of benchmark records (K2.6 width) as fit inputs: {layers, method, B, C, context, skip,
    step_ms, machine, builds, record, touched}. bench_e2e rows ("step": variant, layers, method, B, C, context,
    step_ms, experts_touched when counted) and bench_auto rows ("auto_bench": AR and each fixed candidate's plain
    host-driven step; its estimate and auto rows are other programs) are read; a record holding "runs" gives one
    group per run, numbered in `record`. The machine is the record's ceilings (copy_TBps, matmul_bf16_TFLOPs),
    else `machine`, else an H200's. XLA-default ablations ("no_options") are left out: another program."""
    rows, index = [], 0
    for rec in records:
        for run in rec.get("runs", [rec]):
            if run.get("args", {}).get("preset", "k26") == "k26":
                rows += _run_rows(run, index, machine)
            index += 1
    return rows


def _run_rows(run, index: int, machine: Machine | None) -> list[dict]:
    ceil = run.get("ceilings") or {}
    if "copy_TBps" in ceil:
        machine = Machine(ceil["copy_TBps"], ceil["matmul_bf16_TFLOPs"])
    machine = machine or Machine(4.0, 620.0)
    builds = [r for r in run["rows"] if r.get("kind") == "build" and "build_ms" in r]
    rows = []
    for r in run["rows"]:
        if r.get("kind") == "auto_bench" and "+" not in r["variant"] and r["variant"] != "auto":
            v = r["variant"]
            method = v if v in ("ar", "chain") else "ddtree"
            B = int(v.removeprefix("ddtree")) if method == "ddtree" else 0
            r = dict(r, method=method, B=B)
        elif r.get("kind") != "step" or "step_ms" not in r or "no_options" in r["variant"]:
            continue
        skip = tuple(ABLATIONS[s] for s in r["variant"].split("-")[1:] if s in ABLATIONS)
        rows.append(
            dict(
                layers=r["layers"], method=r["method"], B=r["B"], C=r["C"], context=r["context"], skip=skip,
                step_ms=r["step_ms"], machine=machine, builds=builds, record=index, touched=r.get("experts_touched"),
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
