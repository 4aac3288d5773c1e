"""One GPU's share of the tensor-parallel K2.6 step, run alone on one GPU: what each of n GPUs computes under TP-n.

Under k26jax/sharding.py each of n GPUs holds 1/n of the attention heads, of the vocabulary (embedding, lm_head),
of the dense and shared-expert MLPs and of the drafter (heads, MLP, fc input), and either E/n whole routed experts
("ep") or 1/n of every expert's intermediate dim ("tp"); the router, the norms and the latent KV cache (every MLA
head reads it) are whole. `params.shard_table` gives exactly those shapes from the parameter table. This script
initialises them (random weights, the router's bias balanced over a calibration batch, as a trained K2.6's is) at
depth N (all 61 layers fit one H200: a share is 1/n of the bytes) and times the engine's step on them:
  - the share's config has H/n heads and V/n tokens, so attention, the draft's top-K and the argmax run over the
    share's own slice (the cross-GPU merge of top-K candidates is a small gather, in the collective model);
  - "ep": the router picks k of all E experts per token and only the picks in device 0's range are computed (the
    MoE kernel skips ids outside its experts, as under shard_map);
  - the drafter's fc takes device 0's F/n feature columns (`ShareDraft`);
  - collectives are not run. Each all-reduce and gather of the n-GPU step (bench_e2e.collectives) is counted and
    its cost modelled as --collective-us + ring bytes / --nvlink-GBps; the projected n-GPU step is the measured
    share plus that model (both in the record).
Acceptance: k26jax.synthetic's calibrated drafter (the chain's E[tau] = --tau at b = 8), so tok/s = tau C / step.
Floors: the share's bytes (bench_e2e.traffic at n GPUs, routed experts as device 0's measured touches) over the
copy ceiling of the same run. Two or more --layers fit t = a + b N, and the record projects N = 61 from it.
--profile DIR adds each variant's per-scope and per-kernel breakdown (scripts/trace_report.py).

GPU (one H200; on an H100 80 GB, --layers 40 20):
  python scripts/bench_share.py --layers 61 --out $OUT/share_h200.json
CPU smoke run (tiny shapes, 8-way share; timings mean nothing):
  python scripts/bench_share.py --preset tiny --layers 4 2 --contexts 256 --steps 2 --repeats 1 --out /tmp/share.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

import bench_e2e
import harness
import jax
import jax.numpy as jnp
import numpy as np

from k26jax import engine, ops, routing, synthetic
from k26jax.config import preset
from k26jax.model import drafter as drafter_lib
from k26jax.model import params as param_table
from k26jax.model.layers import mm, rms_norm
from k26jax.step_cost import kimi_drafter_config
from pallas_kernels import few_row_gemm

K26_LAYERS = 61


@dataclasses.dataclass(frozen=True)
class ShareDraft(engine.DFlashDraft):
    """The DFlash drafter of device 0's share: fc's input dim is split, so it multiplies the first F/n feature
    columns (the n partial sums are all-reduced on a real mesh; here that is modelled)."""

    def context_kv(self, dparams, features, positions, *, dcfg):
        fc = dparams["fc"]
        x = features[..., : fc.shape[0]].astype(fc.dtype)
        ctx = rms_norm(mm("btf,fd->btd", x, fc), dparams["hidden_norm"], dcfg.rms_norm_eps)
        return drafter_lib.fused_context_kv(dparams, dcfg, ctx, positions)


@dataclasses.dataclass
class Share:
    """Device 0's share of the depth-N model on n GPUs: configs whose heads and vocabulary are the share's, and
    the share's parameter tables (the full configs stay, for the floors and the collective model)."""

    full_cfg: object
    full_dcfg: object
    n: int
    expert_mode: str

    def __post_init__(self):
        cfg, dcfg, n = self.full_cfg, self.full_dcfg, self.n
        if cfg.num_attention_heads % n or cfg.vocab_size % n:
            raise ValueError(f"heads {cfg.num_attention_heads} and vocab {cfg.vocab_size} must split {n} ways")
        heads = cfg.num_attention_heads // n
        self.cfg = cfg.replace(num_attention_heads=heads, vocab_size=cfg.vocab_size // n)
        split = param_table.drafter_heads_split(dcfg, n)
        self.dcfg = dcfg.replace(
            num_attention_heads=dcfg.num_attention_heads // n if split else dcfg.num_attention_heads,
            num_key_value_heads=dcfg.num_key_value_heads // n if split else dcfg.num_key_value_heads,
            mask_token_id=min(dcfg.mask_token_id, self.cfg.vocab_size - 1),  # a token of the share's vocabulary
        )
        self.table = param_table.shard_table(param_table.target_table(cfg), n, self.expert_mode)
        self.dtable = param_table.shard_table(param_table.drafter_table(dcfg, n), n)

    def init(self, seed: int, dtype):
        return jax.jit(
            lambda: (
                param_table.init_tree(self.table, seed, dtype),
                param_table.init_tree(self.dtable, seed + 1, dtype),
            )
        )()


Variant = bench_e2e.Variant  # layers, method, budget, C, context (no skipped phases here)


class Bench:
    """The share at one depth: its decoders, states, timings and floors."""

    def __init__(self, args, layers: int, ceil: harness.Ceilings):
        self.args, self.layers, self.ceil = args, layers, ceil
        self.tiny = args.preset == "tiny"
        self.dtype = jnp.float32 if self.tiny else jnp.bfloat16
        full = bench_e2e.target_config(args.preset, layers)
        self.share = Share(full, kimi_drafter_config(full, self.tiny), args.gpus, args.expert_mode)
        self.profile = synthetic.fit_profile(args.tau, 8, vocab=self.share.cfg.vocab_size)
        self.impls = self.impls_for(args)

    @staticmethod
    def impls_for(args) -> ops.Impls:
        impls = ops.Impls.auto()
        return impls if args.dense_rows is None else dataclasses.replace(impls, dense_rows=args.dense_rows)

    def decoder(self, v: Variant, impls=None) -> engine.Decoder:
        s = self.share
        budget = max(v.budget, 1)  # AR's tree is its root alone
        sc = engine.StepConfig(method=v.method, budget=budget, max_new_tokens=4096, block_size=s.dcfg.block_size)
        drafter, acceptor = synthetic.synthetic_pair(self.profile, self.args.seed, base=ShareDraft())
        spec = dict(drafter=drafter, acceptor=acceptor) if v.method != "ar" else {}
        return engine.Decoder(s.cfg, s.dcfg if v.method != "ar" else None, sc, impls or self.impls, **spec)

    def _fill(self, v: Variant):
        dec = self.decoder(v)
        need = v.context + (self.args.steps + 2) * dec.sc.block_size + v.budget + 1
        return functools.partial(
            bench_e2e.synthetic_state, cfg=dec.cfg, dcfg=dec.dcfg, sc=dec.sc, C=v.C, S=-(-need // 64) * 64,
            context=v.context, dtype=self.dtype,
        )  # fmt: skip

    def _key(self, v: Variant):
        return jax.random.key(self.args.seed + v.C)

    def compile_all(self, variants: list[Variant], params, dparams) -> dict:
        """Every variant's timed program ("run" of --steps steps) and, per (method, budget, C), one step that reports
        its expert ids to a probe (routing does not depend on the context), compiled in parallel threads before
        anything is timed: {("run", v) | ("probe", v.method, v.budget, v.C): (executable, seconds) or an error}."""

        def timed(compile_fn):
            start = time.perf_counter()
            return compile_fn(), time.perf_counter() - start

        jobs, self.probes, self.probe_states = {}, {}, {}
        for v in variants:
            state = jax.eval_shape(self._fill(v), self._key(v))
            dec = self.decoder(v)
            jobs[("run", v)] = functools.partial(
                timed, lambda d=dec, st=state: d.compile("run", params, dparams, st, num_steps=self.args.steps)
            )
            key = ("probe", v.method, v.budget, v.C)
            if self.share.cfg.n_routed_experts and key not in jobs:
                self.probes[key] = probe = routing.ExpertProbe(self.share.cfg.n_routed_experts)
                self.probe_states[key] = (self._fill(v), self._key(v))  # its own shapes: the context may differ
                pdec = self.decoder(v, dataclasses.replace(self.impls, probe=probe))
                jobs[key] = functools.partial(timed, lambda d=pdec, st=state: d.compile("step", params, dparams, st))
        return harness.compile_all(jobs, workers=self.args.compile_workers)

    def measure(self, v: Variant, params, dparams, compiled: dict) -> dict:
        entry = compiled[("run", v)]
        if isinstance(entry, Exception):
            raise entry
        exe, compile_s = entry
        row = {"kind": "step", "variant": v.name, **dataclasses.asdict(v), "compile_s": compile_s}
        where = None
        if self.args.profile:
            where = os.path.join(self.args.profile, f"share_d{self.layers}_{v.name}_C{v.C}_ctx{v.context}")
        timing, _ = bench_e2e.time_steps(
            exe, params, dparams, jax.jit(self._fill(v))(self._key(v)),
            reset=functools.partial(bench_e2e.reset_state, C=v.C, context=v.context, sharding=None),
            steps=self.args.steps, repeats=self.args.repeats, profile=where, layers=v.layers,
        )  # fmt: skip
        if timing["trace"] is not None:
            row["trace"] = timing["trace"]
        touched = self.touched(v, params, dparams, compiled)
        step_ms = 1e3 * statistics.median(timing["reps"])
        tau = float(timing["accept"].mean()) if v.method != "ar" else 1.0
        row.update(step_ms=step_ms, step_ms_reps=[1e3 * t for t in timing["reps"]], tau_realised=tau)
        row.update(touched_experts=touched, **self.floors(v, touched, step_ms))
        row["tok_s"] = tau * v.C / (row["projected_step_ms"] / 1e3)
        return row

    def touched(self, v: Variant, params, dparams, compiled: dict) -> dict | None:
        """Distinct routed experts per MoE layer in one probed step: all of them, and device 0's range (None
        without routed experts or a probe program: the floor then takes uniform routing)."""
        key = ("probe", v.method, v.budget, v.C)
        entry = compiled.get(key)
        if entry is None or isinstance(entry, Exception):
            return None
        probe, (fill, fill_key) = self.probes[key], self.probe_states[key]
        probe.clear()
        jax.block_until_ready(entry[0](params, dparams, jax.jit(fill)(fill_key)))
        return probe.touched(self.args.gpus)

    def floors(self, v: Variant, touched, step_ms: float) -> dict:
        s, n = self.share, self.args.gpus
        if touched is None:
            local = None
        elif self.args.expert_mode == "ep":
            local = (touched["first_shard"] * n, touched["first_shard"])  # traffic's EP share: local * n / E
        else:
            local = (touched["mean"], touched["mean"])
        parts = bench_e2e.traffic(
            s.full_cfg, s.full_dcfg, v.method, v.budget, v.C, v.context,
            n=n, expert_mode=self.args.expert_mode, dtype=self.dtype, touched=local,
        )  # fmt: skip
        fl = bench_e2e.floor_ms(parts, self.ceil.copy_bytes_per_s / 1e12, self.ceil.matmul_flops / 1e12)
        ops_list = bench_e2e.collectives(s.full_cfg, s.full_dcfg, v.method, v.budget, v.C, n)
        coll_ms = bench_e2e.collective_ms(ops_list, n, self.args.collective_us, self.args.nvlink_GBps)
        return dict(
            floor_ms=fl["floor_ms"],
            x_floor=step_ms / fl["floor_ms"],
            pct_of_floor=100 * fl["floor_ms"] / step_ms,
            bytes_by_part={p: b for p, (b, _) in parts.items()},
            collectives=sum(c for c, _ in ops_list),
            collective_ms=coll_ms,
            projected_step_ms=step_ms + coll_ms,
        )


def project(rows: list[dict], args) -> list[dict]:
    """Per variant measured at two or more depths: the least-squares t = a + b N of the share's step, its value at
    61 layers, and that plus the 61-layer step's modelled collectives."""
    full = bench_e2e.target_config(args.preset, K26_LAYERS)
    dcfg = kimi_drafter_config(full, args.preset == "tiny")
    out, groups = [], {}
    for r in rows:
        if r.get("kind") == "step" and "step_ms" in r:
            groups.setdefault((r["method"], r["budget"], r["C"], r["context"]), []).append(r)
    for (method, budget, C, context), rs in sorted(groups.items()):
        if len({r["layers"] for r in rs}) < 2:
            continue
        b, a = np.polyfit([r["layers"] for r in rs], [r["step_ms"] for r in rs], 1)
        share_ms = a + b * K26_LAYERS
        ops_list = bench_e2e.collectives(full, dcfg, method, budget, C, args.gpus)
        coll_ms = bench_e2e.collective_ms(ops_list, args.gpus, args.collective_us, args.nvlink_GBps)
        tau = statistics.mean(r["tau_realised"] for r in rs)
        row = dict(kind="projection", method=method, budget=budget, C=C, context=context, layers=K26_LAYERS)
        row.update(depths=sorted(r["layers"] for r in rs), fixed_ms=a, per_layer_ms=b, share_step_ms=share_ms)
        row.update(
            collective_ms=coll_ms, projected_step_ms=share_ms + coll_ms, tok_s=tau * C / (share_ms + coll_ms) * 1e3
        )
        out.append(row)
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="k26", choices=("k26", "tiny"))
    ap.add_argument("--layers", type=int, nargs="+", default=[K26_LAYERS], help="depths N (two or more: a fit)")
    ap.add_argument("--gpus", type=int, default=8, help="n: the tensor-parallel width whose share runs")
    ap.add_argument("--expert-mode", default="ep", choices=("ep", "tp"))
    ap.add_argument("--methods", nargs="+", default=["ar", "ddtree"], choices=engine.METHODS)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--tau", type=float, default=5.3, help="the chain's E[tau] at b = 8 (synthetic acceptance)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile-workers", type=int, default=8)
    ap.add_argument("--collective-us", type=float, default=10.0, help="latency per collective, microseconds")
    ap.add_argument("--nvlink-GBps", type=float, default=360.0, help="all-reduce bus bandwidth per GPU, GB/s")
    ap.add_argument("--profile", default=None, help="write jax.profiler traces here and break each step down")
    ap.add_argument(
        "--dense-rows", type=int, default=None, help="ops.Impls.dense_rows for this run (A/B; default Impls.auto's)"
    )
    harness.add_record_args(ap, "bench/results/share.json")
    args = ap.parse_args(argv)
    if args.dense_rows is not None and not 0 <= args.dense_rows <= few_row_gemm.MAX_ROWS:
        ap.error(f"--dense-rows {args.dense_rows}: use 0 (cuBLAS) to {few_row_gemm.MAX_ROWS}")
    dense = preset(args.preset).first_k_dense_replace
    if min(args.layers) <= dense:
        ap.error(f"--layers {min(args.layers)}: a depth must pass the {dense} dense layer(s) to hold a MoE layer")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ceil = harness.measure_ceilings(small=args.preset == "tiny")
    record = harness.record_header(
        args.commit,
        gpus=args.gpus,
        expert_mode=args.expert_mode,
        collective_model={"latency_us": args.collective_us, "busbw_GBps": args.nvlink_GBps, "form": "ring"},
        dense_rows=Bench.impls_for(args).dense_rows,
        ceilings=ceil.record(),
        rows=[],
    )
    for layers in sorted(args.layers, reverse=True):
        bench = Bench(args, layers, ceil)
        start = time.perf_counter()
        params, dparams = jax.block_until_ready(bench.share.init(args.seed, bench.dtype))
        router = None
        if bench.share.cfg.n_routed_experts:
            probe = routing.ExpertProbe(bench.share.cfg.n_routed_experts)
            probe_impls = dataclasses.replace(bench.impls, probe=probe)
            params, router = bench_e2e.balance_router(params, bench.share.cfg, probe_impls, args.seed, tiny=bench.tiny)
        print(f"[share] depth {layers}: parameters and router in {time.perf_counter() - start:.1f}s", flush=True)
        record["rows"].append({"kind": "router", "layers": layers, **(router or {})})
        variants = [
            Variant(layers, method, args.budget if method == "ddtree" else 0, C, context)
            for context in args.contexts
            for C in args.concurrency
            for method in args.methods
        ]
        start = time.perf_counter()
        compiled = bench.compile_all(variants, params, dparams)
        print(f"[share] depth {layers}: {len(compiled)} programs compiled in {time.perf_counter() - start:.1f}s")
        for v in variants:
            try:
                row = bench.measure(v, params, dparams, compiled)
            except Exception as error:  # noqa: BLE001 -- one device call: keep every other figure
                row = {"kind": "step", "variant": v.name, **dataclasses.asdict(v)}
                row["error"] = harness.error_text(error, 2000)
            record["rows"].append(row)
            print(_line(row), flush=True)
            harness.write_json(record, args.out)
        del compiled
        del params, dparams
    record["rows"] += project(record["rows"], args)
    harness.write_json(record, args.out)
    return 0


def _line(row: dict) -> str:
    if "error" in row:
        return f"[{row['variant']} C={row['C']} ctx={row['context']}] {row['error'][:300]}"
    return (
        f"[{row['variant']} N={row['layers']} C={row['C']} ctx={row['context']}] {row['step_ms']:.3f} ms "
        f"({row['x_floor']:.2f}x its {row['floor_ms']:.3f} ms floor), + {row['collective_ms']:.3f} ms "
        f"collectives -> {row['tok_s']:.0f} tok/s at tau {row['tau_realised']:.2f}"
    )


if __name__ == "__main__":
    sys.exit(main())
