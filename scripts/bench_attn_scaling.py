"""Where tree_mla_attention's fixed cost sits (GPU): the whole call and the Mosaic kernel alone (with the XLA glue
in front of it) at prefix lengths that are fractions of S_max under the same split plan, so the difference of two
fractions is the key stream and fraction 0 the cost of everything else; the log-sum-exp merge alone.
With --ncu-point it instead runs that point's whole call three times for `ncu` to time each kernel.

  PYTHONPATH=. python3 scripts/bench_attn_scaling.py --out $OUT/scaling.json --commit SHA [--points C,S,T,H ...]
  ncu --clock-control none --metrics gpu__time_duration.sum --csv \
      python3 scripts/bench_attn_scaling.py --ncu-point 8,32768,1,64
"""

import argparse
import functools
import json

import jax

from pallas_kernels import mla_prefix_mosaic
from pallas_kernels import tree_mla_attention as attn
from scripts.bench_attn_parts import default_plan, kernel_only
from scripts.bench_verify_attn import (
    SCALE,
    make_input_sets,
    new_record,
    num_sets_for,
    plan_summary,
    roofline,
    seconds_per_call,
)

FRACTIONS = (1.0, 0.5, 0.0)


def time_point(point, ceilings):
    C, S, T, H = point
    plan = default_plan(*point)
    parts = {
        "whole": jax.jit(functools.partial(attn.tree_mla_attention, scale=SCALE)),  # compiled once a point
        "kernel": jax.jit(functools.partial(kernel_only, num_splits=None)),
    }
    rows = []
    for fraction in FRACTIONS:
        arg_sets = make_input_sets(*point, num_sets_for(*point), prefix_len=[int(fraction * S)] * C)
        _, _, floor, _ = roofline(*point, arg_sets[0][5], ceilings)
        # partial_bytes: what the merge reads, the real rows' o and lse (the kernel also writes the padding rows)
        row = dict(
            C=C,
            prefix=S,
            T=T,
            H=H,
            prefix_fraction=fraction,
            **plan_summary(plan, C),
            floor_s=floor,
            partial_bytes=len(plan) * T * H * (mla_prefix_mosaic.LAT_DIM + 1) * 4,
        )
        for name, fn in parts.items():
            row[f"{name}_s"] = seconds_per_call(fn, arg_sets)
        if fraction == 1.0:
            partial_sets = [parts["kernel"](*args) for args in arg_sets[:2]]
            merge = jax.jit(lambda o, lse: attn.merge_groups(o, lse, plan, C))
            row["merge_s"] = seconds_per_call(merge, partial_sets)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument(
        "--points",
        nargs="+",
        default=["8,32768,1,64", "8,65536,1,64", "16,32768,1,64", "8,32768,65,8"],
        help="C,S,T,H shapes",
    )
    parser.add_argument("--ncu-point", help="C,S,T,H: only run its whole call three times (for ncu)")
    args = parser.parse_args()
    if args.ncu_point:
        point = tuple(int(x) for x in args.ncu_point.split(","))
        fn = jax.jit(functools.partial(attn.tree_mla_attention, scale=SCALE))
        inputs = make_input_sets(*point, 1)[0]
        for _ in range(3):
            jax.block_until_ready(fn(*inputs))
        return
    if not args.out:
        parser.error("--out is required unless --ncu-point is given")
    record, ceilings = new_record(args.commit, rows=[])
    for point in [tuple(int(x) for x in p.split(",")) for p in args.points]:
        record["rows"] += time_point(point, ceilings)
        json.dump(record, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
