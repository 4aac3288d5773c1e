"""scripts/bench_moe_stream.py: the streaming ablation reads exactly the touched experts' gate/up words."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import int4_moe_gemm as moe
from scripts import bench_moe_stream as stream


@pytest.mark.parametrize("tile_major", [False, True])
def test_stream_sums_the_touched_tiles_in_both_layouts(tile_major):
    num_experts, d, i = 6, 512, 128
    key = jax.random.key(3)
    w13 = jax.lax.bitcast_convert_type(jax.random.bits(key, (num_experts, d // 8, 2, i), jnp.uint32), jnp.int32)
    ids = jnp.asarray([[0, 5], [5, 2], [7, 2]], jnp.int32)  # expert 7 is off this shard
    weights = stream.to_tile_major(w13) if tile_major else w13
    got = np.asarray(stream.stream(weights, ids, tile_major=tile_major, interpret=True))
    expected = stream.stream_reference(w13, ids)
    blocks = np.asarray(moe.sort_routing(ids.reshape(-1), num_experts, stream.BLOCK_M).block_expert)
    assert sorted(int(e) for e in blocks if e >= 0) == [0, 2, 5]
    for b, e in enumerate(blocks):
        if e >= 0:
            np.testing.assert_allclose(got[b], expected[int(e)], rtol=1e-5)
