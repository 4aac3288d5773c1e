"""Benchmark the DDTree tree build and acceptance walk: Pallas kernels vs CPU heapq vs plain XLA.

Per (batch C, budget B, depth L), all requests at budget B with K = B candidates per depth:
  gpu_build_us    tree_build kernel: N calls unrolled in one jit, each call's budgets taken from the previous
                  call's num_nodes (so they serialize), median of repeats / N; includes the jit dispatch and
                  sync amortized over N (tens of us on the H200 run at N=16), so an upper bound
  gpu_build_fori_us  the same N chained calls as one lax.fori_loop (tighter: no per-call dispatch)
  cpu_heapq_ms    k26jax.ddtree end to end as SGLang does it: device-to-host copy of logq/ids [C, L, K]
                  + build_tree_from_topk per request (incl. its visibility), median over fresh inputs
  xla_fori_us     tree_build_reference (lax.fori_loop over pops), C in {1, 64} only
  accept_us       tree_accept kernel with a target that agrees along first children (deepest walk)
  visibility_us   visibility_from_parents (XLA) on the kernel's parents
The copy and bf16-matmul ceilings are measured in the same run. Results go to --out as JSON after every
configuration, so a run stopped by its deadline keeps what it measured.

GPU:  PYTHONUNBUFFERED=1 timeout 140 python scripts/bench_tree.py --deadline-s 105 --out $OUT/tree_h200.json
CPU smoke (interpret mode):  python scripts/bench_tree.py --quick --out /tmp/tree_cpu.json
"""

import argparse
import functools
import itertools
import json
import statistics
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np

from k26jax import ddtree
from pallas_kernels.tree_accept import tree_accept, tree_accept_reference
from pallas_kernels.tree_build import draft_topk, tree_build, tree_build_reference, visibility_from_parents

DRAFT_VOCAB = 8192  # drafter logits per depth used to make logq/ids (the tree only sees the top-K)


def device_seconds(fn, sets, repeats, calls=None):
    """(Seconds per kernel call, the first output) of jit(fn)(sets), which makes `calls` (default len(sets))
    chained kernel calls: one jitted call a round, median of repeats."""
    jitted = jax.jit(fn)
    out = jax.block_until_ready(jitted(sets))
    seconds = harness.median_seconds(lambda i: jitted(sets), calls=1, per_call=calls or len(sets), repeats=repeats)
    return seconds, out


@functools.partial(jax.jit, static_argnames=("shape", "budget"))
def _draft_set(key, shape, budget):
    """Peaked draft logits [C, L, DRAFT_VOCAB] (one spiked token per depth, top-1 prob ~10-99%) -> top-K."""
    noise_key, spike_key, token_key = jax.random.split(key, 3)
    logits = jax.random.normal(noise_key, shape)
    spike = jax.random.uniform(spike_key, shape[:2] + (1,), minval=7.5, maxval=13.5)
    token = jax.random.randint(token_key, shape[:2] + (1,), 0, DRAFT_VOCAB)
    logits = jnp.where(jnp.arange(DRAFT_VOCAB) == token, logits + spike, logits)
    return draft_topk(logits, budget)


def make_sets(key, num_sets, num_requests, budget, depth):
    """`num_sets` independent (logq, ids) [C, L, K=B]."""
    keys = jax.random.split(key, num_sets)
    return jax.block_until_ready([_draft_set(k, (num_requests, depth, DRAFT_VOCAB), budget) for k in keys])


def greedy_post(tokens, parents, num_nodes, rng):
    """Target choice per node: its first drafted child's token, or a token no child has."""
    num_requests, budget = tokens.shape
    post = rng.integers(DRAFT_VOCAB, 2 * DRAFT_VOCAB, (num_requests, budget + 1))
    for c in range(num_requests):
        children = np.arange(num_nodes[c], 0, -1)  # highest index first: the first child is written last
        post[c, parents[c, children]] = tokens[c, children - 1]
    return jnp.asarray(post, jnp.int32)


def measure(row, key, thunk):
    """row[key] = thunk(); a failure is recorded as row[key + '_error'] instead of ending the run."""
    try:
        row[key] = thunk()
    except Exception as error:  # noqa: BLE001 -- one GPU run: keep every other figure
        row[key + "_error"] = repr(error)[:400]
        print(f"{key} failed: {error!r}"[:400], flush=True)


def bench_config(num_requests, budget, depth, args, key, num_warps=None):
    n, repeats, interpret = args.calls, args.repeats, args.quick
    sets = make_sets(key, n + args.cpu_repeats, num_requests, budget, depth)
    budgets = jnp.full((num_requests,), budget, jnp.int32)
    rng = np.random.default_rng(budget * 1000 + num_requests)
    row = dict(
        kind="build" if num_warps is None else "num_warps_sweep",
        C=num_requests,
        B=budget,
        L=depth,
        K=budget,
        num_warps=num_warps,
    )

    # CPU heapq end to end on inputs never fetched before (jax caches host copies)
    copy_times, build_times = [], []
    for logq, ids in sets[n:]:
        start = time.perf_counter()
        logq_host, ids_host = jax.device_get((logq, ids))
        copied = time.perf_counter()
        for c in range(num_requests):
            ddtree.build_tree_from_topk(logq_host[c], ids_host[c], budget)
        build_times.append(time.perf_counter() - copied)
        copy_times.append(copied - start)
    row["cpu_copy_ms"] = 1e3 * statistics.median(copy_times)
    row["cpu_build_ms"] = 1e3 * statistics.median(build_times)
    row["cpu_heapq_ms"] = 1e3 * statistics.median(np.add(copy_times, build_times))

    def build_chain(build, **kw):
        def run(input_sets):
            outs, chained = [], budgets
            for logq, ids in input_sets:
                out = build(logq, ids, chained, max_budget=budget, **kw)
                outs.append(out)
                chained = out[3]
            return outs

        return run

    timed = {}

    def gpu_build():
        seconds, timed["outs"] = device_seconds(
            build_chain(tree_build, interpret=interpret, num_warps=num_warps), sets[:n], repeats
        )
        return 1e6 * seconds

    measure(row, "gpu_build_us", gpu_build)
    if num_warps is None:  # same chain as one lax.fori_loop over a single input set

        def loop_chain(input_sets):
            logq, ids = input_sets[0]
            build = functools.partial(tree_build, logq, ids, max_budget=budget, interpret=interpret)
            return jax.lax.fori_loop(0, n - 1, lambda _, out: build(out[3]), build(budgets))

        measure(row, "gpu_build_fori_us", lambda: 1e6 * device_seconds(loop_chain, sets[:1], repeats, calls=n)[0])
    if "outs" not in timed:
        return row
    outs = timed["outs"]
    tokens, depths, parents, num_nodes = jax.device_get(outs[0])
    logq0, ids0 = jax.device_get(sets[0])
    trees = [ddtree.build_tree_from_topk(logq0[c], ids0[c], budget) for c in range(num_requests)]
    row["matches_reference"] = all(
        np.array_equal(tokens[c], tree.tokens) and np.array_equal(parents[c], tree.parents)
        for c, tree in enumerate(trees)
    )
    row["mean_depth"] = float(depths[depths > 0].mean())
    row["max_depth"] = int(depths.max())
    row["speedup_vs_cpu"] = 1e3 * row["cpu_heapq_ms"] / row["gpu_build_us"]
    if num_warps is not None:
        return row

    tree_parents = [out[2] for out in outs]
    measure(
        row,
        "visibility_us",
        lambda: (
            1e6
            * device_seconds(
                lambda ps: [visibility_from_parents(p, max_depth=depth) for p in ps], tree_parents, repeats
            )[0]
        ),
    )

    accept_sets = []
    for out in outs:
        tokens_n, _, parents_n, nodes_n = jax.device_get(out)
        accept_sets.append((out[0], out[2], greedy_post(tokens_n, parents_n, nodes_n, rng), out[3]))

    def gpu_accept():
        seconds, accepted = device_seconds(
            lambda sets_: [tree_accept(*s, max_depth=depth, interpret=interpret) for s in sets_], accept_sets, repeats
        )
        path, accept_len, bonus = jax.device_get(accepted[0])
        post0 = np.asarray(accept_sets[0][2])
        walks = [ddtree.follow_tree(tokens[c], parents[c], post0[c]) for c in range(num_requests)]
        row["accept_matches_walk"] = all(
            accept_len[c] == len(w[0]) and bonus[c] == w[1] and path[c, : len(w[0])].tolist() == w[0]
            for c, w in enumerate(walks)
        )
        row["mean_accept_len"] = float(accept_len.mean())
        return 1e6 * seconds

    measure(row, "accept_us", gpu_accept)
    if num_requests in (1, 64) or args.quick:
        few = max(2, n // 8)
        measure(
            row, "xla_fori_us", lambda: 1e6 * device_seconds(build_chain(tree_build_reference), sets[:few], repeats)[0]
        )
        if "xla_fori_us" in row and "gpu_build_us" in row:
            row["speedup_vs_xla"] = row["xla_fori_us"] / row["gpu_build_us"]
        measure(
            row,
            "accept_reference_us",
            lambda: (
                1e6
                * device_seconds(
                    lambda sets_: [tree_accept_reference(*s, max_depth=depth) for s in sets_], accept_sets, repeats
                )[0]
            ),
        )
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_record_args(parser, "bench/results/tree.json")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: interpret mode, tiny sizes")
    parser.add_argument("--calls", type=int, default=16, help="kernel calls per timed jit (N)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-repeats", type=int, default=3, help="fresh input sets for the CPU timing")
    parser.add_argument("--deadline-s", type=float, default=115.0, help="stop starting configurations after this")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--depths", type=int, nargs="+", default=[7, 15])
    parser.add_argument(
        "--sweep-budgets",
        type=int,
        nargs="*",
        default=[64, 256],
        help="num_warps sweep at C=64, L=15 for these budgets",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    if args.quick:
        args.calls, args.repeats, args.cpu_repeats = 2, 2, 2
        batches, budgets, depths = (1, 4), (16, 32), (7,)
        sweep = [(4, 16, 7, 2)]
    else:
        batches, budgets, depths = args.batches, args.budgets, args.depths
        sweep = [(64, b, 15, w) for b in args.sweep_budgets for w in (1, 2, 4, 8)]
    configs = sorted(
        itertools.product(batches, budgets, depths),  # the targets first: B=64 at C=1 and 64
        key=lambda cfg: (cfg[1] != 64, cfg[0] not in (1, 64), cfg[1], cfg[0], cfg[2]),
    )
    todo = [(cfg, None) for cfg in configs[:4]] + [(cfg[:3], cfg[3]) for cfg in sweep[:4]]
    todo += [(cfg, None) for cfg in configs[4:]] + [(cfg[:3], cfg[3]) for cfg in sweep[4:]]
    record = harness.record_header(
        args.commit,
        jax=jax.__version__,
        ceilings=harness.measure_ceilings(small=args.quick).record(),
        rows=[],
        skipped=[],
        notes="no pct_of_floor: the build is B dependent argmax pops and the walk L dependent steps, "
        "bound by latency, not by bytes or FLOPs; figures are device time per call "
        f"({args.calls} chained calls per jit, median of {args.repeats})",
    )
    print(json.dumps(record["ceilings"]), flush=True)
    key = jax.random.key(0)
    for (num_requests, budget, depth), num_warps in todo:
        if time.perf_counter() - start > args.deadline_s:
            record["skipped"].append(dict(C=num_requests, B=budget, L=depth, num_warps=num_warps))
            continue
        key, config_key = jax.random.split(key)
        config_start = time.perf_counter()
        row = bench_config(num_requests, budget, depth, args, config_key, num_warps)
        row["config_s"] = time.perf_counter() - config_start
        record["rows"].append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        harness.write_json(record, args.out)
    record["elapsed_s"] = time.perf_counter() - start
    harness.write_json(record, args.out)


if __name__ == "__main__":
    main()
