"""budget="auto" against every fixed choice, through host-driven steps (the loop generate and the server run).

bench_e2e's model (K2.6 width at depth --layers, random weights made on the device, the router's bias balanced
as a trained K2.6's is; tiny shapes with --cpu-mesh8) and its calibrated synthetic acceptance, so each candidate
earns the accept length its tree earns.
Per (C, context) cell, each timed as --steps host-driven steps (dispatch, then the step's tokens and survival to the
host), median over --repeats, caches reset to the context before each repeat:
  * fixed: AR, chain and DDTree at each budget, plain steps (what a fixed --budget runs);
  * estimate: the same chain / DDTree steps with StepConfig.estimate (what auto runs one step in
    --estimate-every): their extra time over the plain step is the cost of the choice's estimate;
  * auto: `autobudget.AutoDecoder` after --explore untimed steps of exploration, then the policy as it runs.
tok/s = tokens emitted / wall time (the synthetic target accepts nothing else). The record gives per cell auto's
tok/s over the best fixed choice's and over DDTree B = 32's, the policy's choices and measured step times.

GPU (one H200):  python scripts/bench_auto.py --layers 8 --out $OUT/auto_h200_depth8.json
CPU, tiny shapes on 8 emulated devices (timings mean nothing; checks the path):
  python scripts/bench_auto.py --cpu-mesh8 --out /tmp/auto_cpu.json
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

if __name__ == "__main__" and "--cpu-mesh8" in sys.argv:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"

import bench_e2e  # noqa: E402
import harness  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from k26jax import autobudget, budget, engine, sharding  # noqa: E402

FETCH = ("num_emitted", "done", "survival", "realised")


def host_loop(step, params, dparams, state, steps: int, fields=FETCH, after=None):
    """`steps` steps, each followed by reading `fields` to the host (and after(host)); (seconds, tokens, state)."""
    tokens, start = 0, time.perf_counter()
    for _ in range(steps):
        state = step(params, dparams, state)
        host = jax.device_get({f: getattr(state, f) for f in fields})
        tokens += int(host["num_emitted"].sum())
        if after is not None:
            after(host)
    return time.perf_counter() - start, tokens, state


class Cell:
    """One (C, context): the parameters, a synthetic state per step family, and the reset between repeats."""

    def __init__(self, setup: bench_e2e.Setup, params, dparams, C: int, context: int, cache_context: int, seed: int):
        self.s, self.params, self.dparams, self.C, self.context = setup, params, dparams, C, context
        self.cache_context = cache_context  # the caches are sized for this context: one shape for every cell of C
        self.key = jax.random.key(seed + C)
        self.states = {}

    def state(self, method: str, estimates: int = 0):
        """A fresh synthetic state for this method's family (AR, speculative, or speculative with `estimates`
        candidates' survival); `reset` sets the lengths."""
        v = bench_e2e.Variant(self.s.layers, method, 32, self.C, self.cache_context)
        kind = "ar" if method == "ar" else f"spec{estimates}"
        if kind not in self.states:
            state = self.s.state_fn(v)(self.key)
            survival = np.zeros((self.C, estimates, state.survival.shape[2]), np.float32)
            realised = np.zeros((self.C, estimates), np.int32)
            put = lambda x: jax.device_put(x, self.s.replicated)
            self.states = {kind: state.replace(survival=put(survival), realised=put(realised))}
        return self.states.pop(kind), kind

    def reset(self, state):
        return bench_e2e.reset_state(state, C=self.C, context=self.context, sharding=self.s.replicated)

    def measure(self, name, method, step, args, fields=FETCH, after=None, before=None, estimates=0) -> dict:
        state, kind = self.state(method, estimates)
        times, tokens = [], []
        for rep in range(args.repeats + 1):  # the first repeat warms up
            if before is not None:
                state = before(self.reset(state))
            seconds, n, state = host_loop(step, self.params, self.dparams, self.reset(state), args.steps, fields, after)
            if rep:
                times.append(seconds)
                tokens.append(n)
        self.states[kind] = state
        t = statistics.median(times)
        n = tokens[times.index(t)] if t in times else int(np.median(tokens))
        row = {"kind": "auto_bench", "variant": name, "C": self.C, "context": self.context, "layers": self.s.layers}
        return row | {
            "step_ms": 1e3 * t / args.steps,
            "tau_realised": n / (args.steps * self.C),
            "tok_s": n / t,
            "reps_s": times,
        }


def plain_decoder(s: bench_e2e.Setup, method: str, b: int) -> engine.Decoder:
    v = bench_e2e.Variant(s.layers, method, b, 1, 0)
    return engine.Decoder(s.cfg, s.dcfg if method != "ar" else None, s.step_config(v), s.impls, **s.acceptance(v))


def compile_plain(cell: Cell, candidates) -> dict:
    """AR's and every candidate's plain step for this cell's shapes, compiled in parallel threads: {label: exe}."""
    jobs = {}
    for m, b in [("ar", 1), *candidates]:
        state, kind = cell.state(m)
        cell.states[kind] = state
        dec = plain_decoder(cell.s, m, b)
        jobs["ar" if m == "ar" else autobudget.label((m, b))] = lambda d=dec, st=state: d.compile(
            "step", cell.params, cell.dparams, st
        )
    compiled = harness.compile_all(jobs, workers=len(jobs))
    for name, exe in compiled.items():
        if isinstance(exe, Exception):
            raise RuntimeError(f"compiling {name}'s step failed: {harness.error_text(exe)}") from exe
    return compiled


def run_cell(cell: Cell, auto: autobudget.AutoDecoder, args, candidates, plain: dict) -> list[dict]:
    """plain: compile_plain's executables for this cell's shapes."""
    rows, n = [], len(candidates)
    state, kind = cell.state("ddtree", n)
    auto.prepare(cell.params, cell.dparams, state)  # compiles each candidate's estimate step once per C
    cell.states[kind] = state
    rows.append(cell.measure("ar", "ar", plain["ar"], args, fields=("num_emitted", "done")))
    for i, (m, b) in enumerate(candidates):
        name = autobudget.label((m, b))
        rows.append(cell.measure(name, m, plain[name], args, fields=("num_emitted", "done")))
        est = cell.measure(f"{name}+estimate", m, auto.executables[i][0], args, estimates=n)
        cost = est["step_ms"] / rows[-1]["step_ms"] - 1
        rows.append(est | {"estimate_cost": cost, "estimate_cost_amortised": cost / auto.estimate_every})
    policy_s, timed = [], collections.Counter()

    def observe(host, record=True):
        if record:
            timed[autobudget.label(candidates[auto.choice])] += 1
        t = time.perf_counter()
        auto.observe(host, np.zeros(cell.C, bool))
        policy_s.append(time.perf_counter() - t)

    def explore(state):  # untimed: the policy tries each candidate twice and settles
        after = lambda host: observe(host, record=False)
        return host_loop(auto.step, cell.params, cell.dparams, state, args.explore, after=after)[2]

    row = cell.measure("auto", "ddtree", auto.step, args, after=observe, before=explore, estimates=n)
    row["choices_timed"] = dict(timed)  # over the warm-up repeat and the timed ones
    row["policy"] = auto.policy.stats()
    row["policy_ms_per_step"] = 1e3 * statistics.median(policy_s)
    fixed = [r for r in rows if "+" not in r["variant"]]
    best = max(fixed, key=lambda r: r["tok_s"])
    b32 = next((r for r in fixed if r["variant"] == "ddtree32"), None)
    row["best_fixed"] = best["variant"]
    row["vs_best_fixed"] = row["tok_s"] / best["tok_s"]
    row["vs_ddtree32"] = row["tok_s"] / b32["tok_s"] if b32 else None
    return rows + [row]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_record_args(ap, "bench/results/auto.json")
    ap.add_argument("--preset", default="k26", choices=("k26", "tiny"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--tau", type=float, default=5.3, help="the synthetic profile's chain E[tau] at b = 8")
    ap.add_argument("--steps", type=int, default=16, help="host-driven steps a repeat times")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--explore", type=int, default=16, help="untimed auto steps before each timed repeat")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--estimate-every", type=int, default=autobudget.ESTIMATE_EVERY, help="auto's estimating steps")
    ap.add_argument("--expert-mode", default="ep", choices=sharding.EXPERT_MODES)
    ap.add_argument("--cpu-mesh8", action="store_true", help="tiny shapes on 8 emulated CPU devices")
    names = [autobudget.label(c) for c in budget.CANDIDATES]
    ap.add_argument("--candidates", nargs="+", default=names, choices=names, help="what auto chooses among")
    args = ap.parse_args(argv)
    if args.estimate_every < 1:
        ap.error(f"--estimate-every {args.estimate_every}: need >= 1")
    if args.steps > bench_e2e.STEPS_CAP or args.explore > bench_e2e.STEPS_CAP:
        ap.error(f"--steps / --explore: at most {bench_e2e.STEPS_CAP} (the caches have room for that many commits)")
    if args.cpu_mesh8:
        args.preset, args.layers, args.concurrency, args.contexts = "tiny", 2, [2], [64]
        args.steps, args.repeats, args.explore = min(args.steps, 6), 1, min(args.explore, 14)
    return args


def e2e_args(args):
    """bench_e2e's arguments for its Setup: this run's shapes, the synthetic acceptance, budgets up to 128."""
    argv = ["--preset", args.preset, "--layers", str(args.layers), "--tau", str(args.tau), "--seed", str(args.seed)]
    argv += ["--expert-mode", args.expert_mode, "--budgets", "128"] + (["--cpu-mesh8"] if args.cpu_mesh8 else [])
    return bench_e2e.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    mesh = sharding.make_mesh()
    eargs = e2e_args(args)
    s = bench_e2e.Setup(eargs, args.layers, mesh)
    record = harness.record_header(args.commit, backend=jax.default_backend(), jax=jax.__version__, args=vars(args))
    record["profile"] = s.profile.__dict__
    record["rows"] = []
    candidates = tuple(c for c in budget.CANDIDATES if autobudget.label(c) in args.candidates)
    params, dparams = jax.block_until_ready(s.init_fn()())
    params, router = s.balance(params)  # a trained K2.6's balanced load, not a random router's few experts
    if router:
        record["rows"].append(router)
    v = bench_e2e.Variant(args.layers, "ddtree", 32, 1, 0)
    template = s.step_config(v)
    for C in args.concurrency:
        kw = s.acceptance(v) | {"estimate_every": args.estimate_every}
        auto = autobudget.AutoDecoder(s.cfg, s.dcfg, template, s.impls, candidates, **kw)
        plain = None  # one shape per C: the caches are sized for the largest context
        for context in args.contexts:
            print(f"[auto] C={C} context={context}: compiling and timing", flush=True)
            cell = Cell(s, params, dparams, C, context, max(args.contexts), args.seed)
            plain = plain or compile_plain(cell, candidates)
            rows = run_cell(cell, auto, args, candidates, plain)
            record["rows"] += rows
            harness.write_json(record, args.out)
            a = rows[-1]
            print(
                f"[auto] C={C} ctx={context}: auto {a['tok_s']:.1f} tok/s = {a['vs_best_fixed']:.3f} x best fixed "
                f"({a['best_fixed']}), choices {a['choices_timed']}",
                flush=True,
            )
    harness.write_json(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
