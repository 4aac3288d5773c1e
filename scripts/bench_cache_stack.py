"""A/B on the GPU: a layer scan of tree MLA attention that slices each layer's latent cache out of the stack
(the model before `layer=`) against one that passes the whole stack and the layer index (the model now).

  PYTHONPATH=. python3 scripts/bench_cache_stack.py --out bench/results/cache_stack_h200.json

Each scan chains L layers (a layer's output is the next layer's q_lat), as the model does. Both forms run the
same kernels on the same data, so their outputs must be identical; the difference is the per-layer copy of
C * S_max * 576 bf16 values that a slice in front of a custom call makes. Median of repeated timed calls.
"""

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.tree_mla_attention import tree_mla_attention
from scripts.bench_attn_layer_scan import layer_scan
from scripts.bench_verify_attn import SCALE, P, R, random_tree_visibility

POINTS = (
    (8, 32768, 1, 64),
    (8, 32768, 1, 8),
    (8, 32768, 65, 8),
    (8, 32768, 65, 64),
    (8, 8192, 65, 64),
    (1, 8192, 1, 64),
)  # (C, S_max, T, H)


def layer_scans():
    """(sliced, in_place) jitted f(q_lat, q_rope, stack, prefix_len, tail, visibility) -> last layer's output."""

    def sliced(q_lat, q_rope, stack, prefix_len, tail, visibility):
        def body(q, cache_layer):
            return tree_mla_attention(q, q_rope, cache_layer, prefix_len, tail, visibility, scale=SCALE), None

        return jax.lax.scan(body, q_lat, stack)[0]

    return jax.jit(sliced), jax.jit(layer_scan)  # layer_scan runs every layer of the stack it is given


def median_seconds(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    commit = (
        args.commit
        or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    record = {
        "device": jax.devices()[0].device_kind,
        "commit": commit or "unknown",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python3"] + sys.argv),
        "layers": args.layers,
        "rows": [],
    }
    sliced, in_place = layer_scans()
    rng = np.random.default_rng(0)
    for C, S, T, H in POINTS:
        keys = jax.random.split(jax.random.key(C * S + T * H), 4)
        normal = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16)
        operands = (
            normal(keys[0], (C, T, H, R)),
            normal(keys[1], (C, T, H, P)),
            normal(keys[2], (args.layers, C, S, R + P)),
            jnp.full((C,), S - 7, jnp.int32),
            normal(keys[3], (C, T, R + P)),
            jnp.asarray(random_tree_visibility(rng, C, T)),
        )
        out_sliced, out_in_place = sliced(*operands), in_place(*operands)
        identical = bool(jnp.array_equal(out_sliced, out_in_place))
        t_sliced = median_seconds(sliced, operands, args.repeats)
        t_in_place = median_seconds(in_place, operands, args.repeats)
        cache_layer_bytes = C * S * (R + P) * 2
        row = {
            "C": C,
            "S_max": S,
            "T": T,
            "H": H,
            "identical_outputs": identical,
            "sliced_ms_per_layer": t_sliced / args.layers * 1e3,
            "in_place_ms_per_layer": t_in_place / args.layers * 1e3,
            "saved_ms_per_layer": (t_sliced - t_in_place) / args.layers * 1e3,
            "cache_layer_MB": cache_layer_bytes / 1e6,
            "copy_at_4TBps_ms": 2 * cache_layer_bytes / 4.0e12 * 1e3,
        }
        record["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        del operands, out_sliced, out_in_place


if __name__ == "__main__":
    main()
