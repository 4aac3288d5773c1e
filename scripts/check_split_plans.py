"""GPU check of prefix split plans (bf16 kernel vs float32 references): the Mosaic kernel's partials against
`mla_prefix_reference` under given plans (ragged prefixes, empty groups, sequences interleaved), then whole tree
attention at the two shapes whose default plans are uneven (the first with ragged prefixes) and at a decode
shape (one tail row, ragged prefixes), and on one layer of a cache stack.

  PYTHONPATH=. python3 scripts/check_split_plans.py --out $OUT/checks.json --commit SHA
"""

import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import mla_prefix_mosaic as mp
from pallas_kernels import tree_mla_attention as attn
from scripts.bench_attn_parts import default_plan
from scripts.bench_verify_attn import (
    SCALE,
    make_input_sets,
    plan_summary,
    record_header,
    reference_output,
    relative_error,
)

QK_SCALE = 0.06


def partial_checks():
    rng = np.random.default_rng(0)
    C, M, S, T = 4, 100, 3008, 70  # 47 key blocks a sequence; the second row tile and tail block run past the end
    prefix_len = jnp.asarray([0, 1, 1234, 3008], jnp.int32)
    q, cache, tail = (
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in ((C, M, 576), (C, S, 576), (C, T, 576))
    )
    visible = jnp.asarray(rng.random((C, M, T)) < 0.4).at[:, :, 0].set(True)
    interleaved = ((2, 0, 10), (0, 0, 47), (3, 0, 30), (2, 10, 11), (1, 0, 20), (3, 30, 47), (2, 11, 47), (1, 20, 47))
    for plan in (mp.equal_plan((1, 3, 2, 3), C, 47), mp.equal_plan(3, C, 47), interleaved):
        args = q[..., : mp.LAT_DIM], q[..., mp.LAT_DIM :], cache, prefix_len, tail, visible
        o, lse = mp.mla_prefix_attention(*args, plan=plan, qk_scale=QK_SCALE)
        o_ref, lse_ref = mp.mla_prefix_reference(*args, plan=plan, qk_scale=QK_SCALE)
        seen = np.isfinite(np.asarray(lse_ref))
        merged = attn.merge_groups(o, lse, plan, C)
        yield dict(
            plan=plan,
            same_empty=bool((np.isfinite(np.asarray(lse)) == seen).all()),
            lse_max_abs=float(np.abs(np.asarray(lse)[seen] - np.asarray(lse_ref)[seen]).max()),
            merged_rel_err=relative_error(merged, attn.merge_groups(o_ref, lse_ref, plan, C)),
            finite=bool(np.isfinite(np.asarray(merged)).all()),
        )


def tree_checks():
    for point, prefix_len in [
        ((8, 32768, 65, 8), [32768, 0, 5, 20000, 32768, 1, 32000, 64]),
        ((16, 8192, 129, 8), None),
        ((4, 8192, 1, 64), [8192, 0, 1, 5000]),
    ]:
        args = make_input_sets(*point, 1, seed=3, prefix_len=prefix_len)[0]
        out = jax.jit(functools.partial(attn.tree_mla_attention, scale=SCALE))(*args)
        yield dict(
            point=point,
            **plan_summary(default_plan(*point), point[0]),
            rel_err=relative_error(out, reference_output(args)),
            finite=bool(jnp.isfinite(out.astype(jnp.float32)).all()),
        )


def layer_checks():
    """The wrapper on layer 2 of a [3, C, S, 576] cache stack (each group's cache row is layer * C + c) against the
    float32 reference on that layer, at a shape whose plan interleaves sequences, with ragged prefixes."""
    point, prefix_len = (8, 8192, 65, 8), [8192, 0, 5, 6000, 8192, 1, 7000, 64]
    q_lat, q_rope, cache, lens, tail, vis = make_input_sets(*point, 1, seed=4, prefix_len=prefix_len)[0]
    stack = jnp.stack([jnp.roll(cache, shift, axis=1) for shift in (1, 2, 0)])
    out = jax.jit(functools.partial(attn.tree_mla_attention, scale=SCALE))(
        q_lat, q_rope, stack, lens, tail, vis, layer=jnp.int32(2)
    )
    yield dict(
        point=point,
        layer=2,
        **plan_summary(default_plan(*point), point[0]),
        rel_err=relative_error(out, reference_output((q_lat, q_rope, cache, lens, tail, vis))),
        finite=bool(jnp.isfinite(out.astype(jnp.float32)).all()),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    record = record_header(args.commit, rows=[])
    for row in itertools.chain(partial_checks(), tree_checks(), layer_checks()):
        record["rows"].append(row)
        print(row, flush=True)
    json.dump(record, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
