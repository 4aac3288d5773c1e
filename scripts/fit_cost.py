"""Fit the step cost model (k26jax.step_cost) on measured records and check it on held-out cells.

    python scripts/fit_cost.py RECORD [RECORD ...] [--ridge 0.05 0.2] [--copy-tbps T --matmul-tflops F]
                               [--out bench/results/cost_fit.json]

RECORD: bench_e2e or bench_auto records (a record holding "runs" gives one group per run). Each group, one
machine's measurements, is fitted on its own: machines of one kind differ by up to a third in step time, which
one model of the roofline terms cannot absorb. Per group and ridge: the coefficients fitted on every cell, then
leave one cell out (fit on the rest, predict it) for each cell; the record gives every held-out error and their
median and maximum. Records without ceilings use --copy-tbps / --matmul-tflops (measured the same day).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from k26jax import step_cost

DEFAULT_OUT = "bench/results/cost_fit.json"


def fit_group(rows: list[dict], ridge: float) -> dict:
    """The model fitted on every row, and the held-out error of each cell."""
    cost = step_cost.fit(rows, ridge=ridge)  # the router skew is searched: older records have unbalanced routers
    held = step_cost.holdout(rows, ridge=ridge)
    errors = [abs(h["rel_err"]) for h in held]
    return {
        "ridge": ridge,
        "cells": len(held),
        "coef": dict(cost.coef),
        "build": list(cost.build),
        "holdout_median_abs": statistics.median(errors),
        "holdout_max_abs": max(errors),
        "holdout": [
            {"cell": "/".join(map(str, h["cell"][:5])), **{k: h[k] for k in ("measured", "predicted", "rel_err")}}
            for h in held
        ],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+")
    ap.add_argument("--ridge", type=float, nargs="+", default=[0.2], help="pull toward the prior (step_cost.fit)")
    ap.add_argument("--copy-tbps", type=float, default=None, help="for records without ceilings")
    ap.add_argument("--matmul-tflops", type=float, default=None, help="for records without ceilings")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if (args.copy_tbps is None) != (args.matmul_tflops is None):
        ap.error("--copy-tbps and --matmul-tflops go together")
    machine = step_cost.Machine(args.copy_tbps, args.matmul_tflops) if args.copy_tbps else None
    records = []
    for path in args.records:
        try:
            with open(path) as f:
                records.append(json.load(f))
        except (OSError, json.JSONDecodeError) as error:
            print(f"error: {path}: {error}", file=sys.stderr)
            return 2
    rows = step_cost.record_rows(records, machine)
    groups = sorted({r["record"] for r in rows})
    default = {"copy_TBps": args.copy_tbps, "matmul_bf16_TFLOPs": args.matmul_tflops}
    out = {"records": args.records, "ridges": args.ridge, "machine_without_ceilings": default, "groups": []}
    for g in groups:
        grows = [r for r in rows if r["record"] == g]
        if len({(r["method"], r["B"], r["C"], r["context"], r["skip"]) for r in grows}) < 3:
            continue  # too few cells to hold one out
        fits = [fit_group(grows, ridge) for ridge in args.ridge]
        out["groups"].append({"group": g, "rows": len(grows), "fits": fits})
        for f in fits:
            print(
                f"[group {g}] {f['cells']} cells, ridge {f['ridge']}: held-out |error| median "
                f"{100 * f['holdout_median_abs']:.1f}%, max {100 * f['holdout_max_abs']:.1f}%",
                flush=True,
            )
    if not out["groups"]:
        print("error: no group with three or more measured cells in these records", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
