"""GPU check of per-sequence prefix split counts (bf16 kernel vs float32 references): the Mosaic kernel's partials
against `mla_prefix_reference` at given counts (ragged prefixes, empty splits), then whole tree attention at the
two shapes whose default counts differ per sequence (the first with ragged prefixes).

  PYTHONPATH=. python3 scripts/check_split_counts.py --out $OUT/checks.json
"""
import argparse
import functools
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import mla_prefix_mosaic as mp, tree_mla_attention as attn
from scripts.bench_attn_parts import default_splits
from scripts.bench_verify_attn import SCALE, make_input_sets, reference_output, relative_error

QK_SCALE = 0.06


def partial_checks():
  rng = np.random.default_rng(0)
  C, M, S, T = 4, 128, 3008, 70
  prefix_len = jnp.asarray([0, 1, 1234, 3008], jnp.int32)
  q, cache, tail = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
                    for shape in ((C, M, 576), (C, S, 576), (C, T, 576)))
  visible = jnp.asarray(rng.random((C, M, T)) < 0.4).at[:, :, 0].set(True)
  for counts in ((1, 3, 2, 3), (3, 3, 3, 3), (2, 1, 3, 1)):
    o, lse = mp.mla_prefix_attention(q, cache, prefix_len, tail, visible, num_splits=counts, qk_scale=QK_SCALE)
    o_ref, lse_ref = mp.mla_prefix_reference(q, cache, prefix_len, tail, visible, num_splits=counts,
                                             qk_scale=QK_SCALE)
    seen = np.isfinite(np.asarray(lse_ref))
    merged = attn._merge_partials(o, lse)
    yield dict(counts=list(counts), same_empty=bool((np.isfinite(np.asarray(lse)) == seen).all()),
               lse_max_abs=float(np.abs(np.asarray(lse)[seen] - np.asarray(lse_ref)[seen]).max()),
               merged_rel_err=relative_error(merged, attn._merge_partials(o_ref, lse_ref)),
               finite=bool(np.isfinite(np.asarray(merged)).all()))


def tree_checks():
  for point, prefix_len in [((8, 32768, 65, 8), [32768, 0, 5, 20000, 32768, 1, 32000, 64]),
                            ((16, 8192, 129, 8), None)]:
    args = make_input_sets(*point, 1, seed=3, prefix_len=prefix_len)[0]
    out = jax.jit(functools.partial(attn.tree_mla_attention, scale=SCALE))(*args)
    yield dict(point=point, counts=list(default_splits(*point)), rel_err=relative_error(out, reference_output(args)),
               finite=bool(jnp.isfinite(out.astype(jnp.float32)).all()))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True)
  out_path = parser.parse_args().out
  rows = []
  for row in itertools.chain(partial_checks(), tree_checks()):
    rows.append(row)
    print(row, flush=True)
  json.dump(rows, open(out_path, "w"), indent=1)


if __name__ == "__main__":
  main()
