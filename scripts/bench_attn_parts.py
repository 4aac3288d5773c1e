"""Where tree_mla_attention's time goes on the GPU: the whole call, its Mosaic kernel alone (prefix splits and
the tail, with the XLA ops the wrapper puts in front of it), the rest (log-sum-exp merge, glue) as the
difference, and the whole call at other prefix split counts (equal splits, the same count for every sequence,
against the wrapper's split plan).

  PYTHONPATH=. python3 scripts/bench_attn_parts.py --out bench/results/attn_parts_h200.json --commit SHA \
      [--points 8,32768,65,8 ...]
"""

import argparse
import functools
import json

import jax.numpy as jnp

from pallas_kernels import mla_prefix_mosaic
from pallas_kernels import tree_mla_attention as attn
from scripts.bench_verify_attn import (
    SCALE,
    compile_all,
    make_input_sets,
    new_record,
    num_sets_for,
    plan_summary,
    roofline,
    seconds_per_call,
)

POINTS = {  # (C, S, T, H): split counts to race besides the wrapper's choice
    (8, 32768, 65, 8): (3, 4, 9),
    (16, 8192, 129, 8): (3, 4),
    (8, 32768, 1, 64): (8, 12, 20),
    (8, 32768, 65, 64): (),
    (1, 8192, 65, 64): (1, 3, 4),
    (16, 4096, 33, 64): (1, 2),
    (1, 8192, 33, 64): (2, 4, 6),
    (8, 1024, 65, 64): (1,),
}


def default_plan(C, S, T, H):
    """The wrapper's split plan (`tree_mla_attention.mosaic_plan`)."""
    return attn.mosaic_plan(C, T * H, S, T)


def kernel_only(
    q_lat,
    q_rope,
    cache,
    prefix_len,
    tail,
    visibility,
    *,
    num_splits,
    prefix_attention=mla_prefix_mosaic.mla_prefix_attention,
):
    """The Mosaic kernel's partials (o [G, M, R], lse [G, M]: prefix splits and tail) on tree_mla_attention's
    arguments, prepared as it does."""
    C, T, H, R = q_lat.shape
    o, lse, _ = attn._mosaic_attention(
        q_lat.reshape(C, T * H, R),
        q_rope.reshape(C, T * H, -1),
        cache,
        jnp.arange(C, dtype=jnp.int32),
        prefix_len,
        tail,
        visibility,
        num_splits=num_splits,
        qk_scale=SCALE * attn._LOG2E,
        interpret=False,
        prefix_attention=prefix_attention,
    )
    return o, lse


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--points", nargs="+", help="C,S,T,H shapes (default: all of POINTS)")
    args = parser.parse_args()
    points = [tuple(int(x) for x in p.split(",")) for p in args.points] if args.points else list(POINTS)
    record, ceilings = new_record(args.commit, rows=[])
    jobs = {}
    for point in points:
        chosen = default_plan(*point)
        jobs[(point, "kernel", chosen)] = (functools.partial(kernel_only, num_splits=None), point)
        jobs[(point, "whole", chosen)] = (functools.partial(attn.tree_mla_attention, scale=SCALE), point)
        num_m_blocks, num_key_blocks, _ = attn.mosaic_tiles(point[2] * point[3], point[1], point[2])
        uniform = attn.choose_num_splits(point[0] * num_m_blocks, num_key_blocks, attn._NUM_SMS)  # one count for all
        for n in sorted({uniform, *POINTS.get(point, ())}):
            if mla_prefix_mosaic.equal_plan(n, point[0], num_key_blocks) != chosen:  # else timed as the wrapper's
                jobs[(point, "whole", n)] = (
                    functools.partial(attn.tree_mla_attention, scale=SCALE, num_splits=n),
                    point,
                )
    compiled = compile_all(jobs)
    for point in points:
        arg_sets = make_input_sets(*point, num_sets_for(*point))
        _, _, floor, _ = roofline(*point, arg_sets[0][5], ceilings)
        for (p, part, n), fn in compiled.items():
            if p != point:
                continue
            row = dict(
                C=point[0],
                prefix=point[1],
                T=point[2],
                H=point[3],
                part=part,
                **(plan_summary(n, point[0]) if isinstance(n, tuple) else {"num_splits": n}),
                default_plan=n == default_plan(*point),
                floor_s=floor,
            )
            if isinstance(fn, Exception):
                row["error"] = f"{type(fn).__name__}: {str(fn)[:200]}"
            else:
                row["time_s"] = seconds_per_call(fn, arg_sets)
                row["pct_of_floor"] = 100 * floor / row["time_s"]
            record["rows"].append(row)
            print(json.dumps(row), flush=True)
        del arg_sets
        json.dump(record, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
