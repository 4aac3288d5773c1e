"""A/B race of Mosaic prefix-kernel variants, kernel alone, in one process on the same inputs: this tree's
`pallas_kernels/mla_prefix_mosaic.py` ("head") against module files given as NAME=PATH (e.g. an older or a
branch's copy: `git show seesaw:pallas_kernels/mla_prefix_mosaic.py > ab/seesaw.py`). Each row has every
variant's time, % of the floor and merged output's rel diff from head; every variant runs the wrapper's split
plan, so each must take `plan=` and write each group's partial at its `partial_slots` slot (the kernel API
since the partial slots, 2026-12-04). MOSAIC_GPU_DUMP_PTXAS=1 prints each compile's registers and spills.

  PYTHONPATH=. python3 scripts/race_mla_prefix.py --variant seesaw=ab/seesaw.py --out $OUT/race.json --commit SHA
"""

import argparse
import functools
import importlib.util
import json
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import mla_prefix_mosaic
from pallas_kernels import tree_mla_attention as attn
from scripts.bench_attn_parts import default_plan, kernel_only
from scripts.bench_verify_attn import (
    make_input_sets,
    new_record,
    num_sets_for,
    plan_summary,
    roofline,
    seconds_per_call,
)


def load_module(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", default=[], help="NAME=PATH of a module file to race")
    parser.add_argument(
        "--points", nargs="+", default=["8,32768,65,64", "8,32768,65,8", "8,32768,1,64"], help="C,S,T,H shapes"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    variants = {"head": mla_prefix_mosaic}
    for spec in args.variant:
        name, _, path = spec.partition("=")
        if not name or not path:
            parser.error(f"--variant wants NAME=PATH, got {spec!r}")
        variants[name] = load_module(name, path)
    record, ceilings = new_record(args.commit, rows=[])
    for point in [tuple(int(x) for x in p.split(",")) for p in args.points]:
        C, S, T, H = point
        arg_sets = make_input_sets(C, S, T, H, num_sets_for(*point))
        _, _, floor, _ = roofline(*point, arg_sets[0][5], ceilings)
        plan = default_plan(*point)
        row, head_out = dict(C=C, prefix=S, T=T, H=H, **plan_summary(plan, C), floor_s=floor), None
        for name, module in variants.items():  # each with the wrapper's split plan
            print(f"=== {name} {point}", file=sys.stderr, flush=True)
            fn = jax.jit(functools.partial(kernel_only, num_splits=None, prefix_attention=module.mla_prefix_attention))
            out = attn.merge_groups(*fn(*arg_sets[0]), plan, C)
            head_out = out if head_out is None else head_out
            row[f"{name}_rel_diff"] = float(jnp.linalg.norm(out - head_out) / jnp.linalg.norm(head_out))
            row[f"{name}_s"] = seconds_per_call(fn, arg_sets)
            row[f"{name}_pct_of_floor"] = 100 * floor / row[f"{name}_s"]
        print(json.dumps(row), flush=True)
        record["rows"].append(row)
        json.dump(record, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
