"""fused_moe on the GPU at K2.6 shapes (384 experts, top-8, D = 7168, I = 2048, bf16) against fused_moe_reference:
the wrapper's default (the Mosaic kernels at every M), the Mosaic kernels at each block size, the Triton kernels
at their default tiling, and the expert-parallel offset with a layer of a stack. Measured relative errors:
2.4e-3 to 2.7e-3 for Mosaic (each pair's row rounded to bf16, as transformers does), 3.8e-4 to 1.0e-3 for Triton."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import int4_moe_gemm as moe
from pallas_kernels import int4_moe_mosaic

pytestmark = pytest.mark.gpu

E, TOP_K, D, I = 384, 8, 7168, 2048
TOL = 5e-3


def relative_error(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def random_experts(key, num_experts, layers=None):
    """Packed INT4 experts in the kernel layout ([layers, E, ...] when stacked); scales keep |y| near |x|."""
    lead = (num_experts,) if layers is None else (layers, num_experts)
    k13, k2, ks13, ks2 = jax.random.split(key, 4)
    bits = lambda k, shape: jax.lax.bitcast_convert_type(jax.random.bits(k, lead + shape, jnp.uint32), jnp.int32)
    scale = lambda k, shape, fan_in: (
        jax.random.uniform(k, lead + shape, minval=0.5, maxval=1.5) / (4 * fan_in**0.5)
    ).astype(jnp.bfloat16)
    return (
        bits(k13, (D // 8, 2, I)),
        scale(ks13, (D // 32, 2, I), D),
        bits(k2, (I // 8, D)),
        scale(ks2, (I // 32, D), I),
    )


def routing(m, num_experts, seed):
    """x [m, D] bf16, uniform top-k ids (distinct per token) and weights."""
    k_x, k_ids, k_w = jax.random.split(jax.random.key(seed), 3)
    ids = jax.lax.top_k(jax.random.uniform(k_ids, (m, num_experts)), TOP_K)[1].astype(jnp.int32)
    weights = jax.random.uniform(k_w, (m, TOP_K), minval=0.1, maxval=0.4)
    return jax.random.normal(k_x, (m, D), jnp.bfloat16), ids, weights


@pytest.fixture(scope="module")
def experts():
    return random_experts(jax.random.key(0), E)


def check(fn, m, experts, seed=1, **reference_kwargs):
    x, ids, weights = routing(m, E, seed)
    y = jax.jit(fn)(x, ids, weights, *experts)
    y_ref = jax.jit(functools.partial(moe.fused_moe_reference, **reference_kwargs))(x, ids, weights, *experts)
    assert y.shape == (m, D) and y.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(y, np.float32)).all()
    assert relative_error(y, y_ref) < TOL


@pytest.mark.parametrize("m", [1, 2, 4, 16, 264, 1024, 4096])
def test_default(experts, m):
    check(moe.fused_moe, m, experts)


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_mosaic_block_sizes(experts, block_m):
    check(functools.partial(int4_moe_mosaic.fused_moe_mosaic, block_m=block_m), 512, experts)


@pytest.mark.parametrize("m", [1, 16, 1024])
def test_triton_default_tiling(experts, m):
    tiling = moe.fit_tiling(moe.choose_tiling(m, TOP_K), D, I)
    check(functools.partial(moe.fused_moe, tiling=tiling), m, experts)


@pytest.mark.parametrize("m", [1, 300])
def test_expert_offset_and_layer_of_a_stack(m):
    """Layer 1 of a 2-layer stack holding experts [192, 384): ids below the offset contribute nothing."""
    stack = random_experts(jax.random.key(5), E // 2, layers=2)
    kwargs = dict(expert_offset=E // 2, layer=jnp.int32(1))
    check(functools.partial(moe.fused_moe, **kwargs), m, stack, **kwargs)
