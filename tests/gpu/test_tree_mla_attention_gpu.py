"""tree_mla_attention on the GPU (bf16, compiled kernels) against the float32 reference: both prefix kernels on
ragged prefixes (0 and 1 included), random trees up to 129 rows, query row counts that are no multiple of 64 and
tails of 1, 5 and 9 rows (the Mosaic kernel reads those unpadded); the Mosaic kernel's partials under given split
plans (empty groups, sequences interleaved); whole calls under the default plans (uneven ones, ragged prefixes);
one layer of a cache stack. bf16 inputs and outputs: relative errors of 1.1e-3 to 1.8e-3 were measured."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k26jax import ddtree
from pallas_kernels import mla_prefix_mosaic as mp
from pallas_kernels import tree_mla_attention as attn
from pallas_kernels.mla_splits import equal_plan

pytestmark = pytest.mark.gpu

R, P = 512, 64
SCALE, QK_SCALE = 0.1, 0.06
TOL = 5e-3


def relative_error(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def operands(C, S, T, H, prefix_len, seed):
    """bf16 (q_lat, q_rope, cache, prefix_len, tail, visibility of random trees)."""
    rng = np.random.default_rng(seed)
    parents = [[-1] + [int(rng.integers(0, i)) for i in range(1, T)] for _ in range(C)]
    visibility = np.stack([ddtree.visibility_from_parents(p) for p in parents])
    k = jax.random.split(jax.random.key(seed), 4)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16)
    return (
        normal(k[0], (C, T, H, R)),
        normal(k[1], (C, T, H, P)),
        normal(k[2], (C, S, R + P)),
        jnp.asarray(prefix_len, jnp.int32),
        normal(k[3], (C, T, R + P)),
        jnp.asarray(visibility),
    )


def reference(args):
    f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    return jax.jit(functools.partial(attn.tree_mla_attention_reference, scale=SCALE))(*f32)


def check(out, args):
    assert bool(jnp.isfinite(out.astype(jnp.float32)).all())
    assert relative_error(out, reference(args)) < TOL


@pytest.mark.parametrize("prefix_kernel", ["triton", "mosaic"])
@pytest.mark.parametrize(
    "C, S, T, H, prefix_len",
    [
        (3, 3008, 33, 64, [3008, 0, 1234]),
        (4, 1000, 1, 64, [1000, 1, 127, 0]),
        (2, 776, 9, 8, [5, 776]),
        (2, 1024, 1, 8, [1024, 3]),
        (2, 1000, 129, 8, [0, 999]),
        (2, 1024, 5, 64, [1024, 0]),
    ],
)
def test_both_prefix_kernels_match_the_reference(prefix_kernel, C, S, T, H, prefix_len):
    args = operands(C, S, T, H, prefix_len, seed=7)
    check(jax.jit(functools.partial(attn.tree_mla_attention, scale=SCALE, prefix_kernel=prefix_kernel))(*args), args)


INTERLEAVED = ((2, 0, 10), (0, 0, 47), (3, 0, 30), (2, 10, 11), (1, 0, 20), (3, 30, 47), (2, 11, 47), (1, 20, 47))


@pytest.mark.parametrize("plan", [equal_plan((1, 3, 2, 3), 4, 47), equal_plan(3, 4, 47), INTERLEAVED])
def test_mosaic_partials_under_split_plans(plan):
    """47 key blocks a sequence; the second row tile and the tail block run past the end."""
    rng = np.random.default_rng(0)
    C, M, S, T = 4, 100, 3008, 70
    q, cache, tail = (
        jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for shape in ((C, M, 576), (C, S, 576), (C, T, 576))
    )
    visible = jnp.asarray(rng.random((C, M, T)) < 0.4).at[:, :, 0].set(True)
    args = q[..., : mp.LAT_DIM], q[..., mp.LAT_DIM :], cache, jnp.asarray([0, 1, 1234, 3008], jnp.int32), tail, visible
    o, lse = mp.mla_prefix_attention(*args, plan=plan, qk_scale=QK_SCALE)
    o_ref, lse_ref = mp.mla_prefix_reference(*args, plan=plan, qk_scale=QK_SCALE)
    seen = np.isfinite(np.asarray(lse_ref))
    assert (np.isfinite(np.asarray(lse)) == seen).all()  # the same groups saw nothing
    assert np.abs(np.asarray(lse)[seen] - np.asarray(lse_ref)[seen]).max() < 1e-3
    merged = attn.merge_groups(o, lse, plan, C)
    assert np.isfinite(np.asarray(merged)).all()
    assert relative_error(merged, attn.merge_groups(o_ref, lse_ref, plan, C)) < TOL


@pytest.mark.parametrize(
    "point, prefix_len",
    [
        ((8, 32768, 65, 8), [32768, 0, 5, 20000, 32768, 1, 32000, 64]),  # an uneven plan, ragged prefixes
        ((16, 8192, 129, 8), [8192] * 16),  # an uneven plan
        ((4, 8192, 1, 64), [8192, 0, 1, 5000]),  # decode: one tail row
    ],
)
def test_whole_calls_under_the_default_plans(point, prefix_len):
    args = operands(*point, prefix_len, seed=3)
    check(jax.jit(functools.partial(attn.tree_mla_attention, scale=SCALE))(*args), args)


def test_layer_of_a_cache_stack():
    """Layer 2 of a [3, C, S, 576] stack (each group's cache row is layer * C + c) under an interleaved plan."""
    q_lat, q_rope, cache, lens, tail, vis = operands(8, 8192, 65, 8, [8192, 0, 5, 6000, 8192, 1, 7000, 64], seed=4)
    stack = jnp.stack([jnp.roll(cache, shift, axis=1) for shift in (1, 2, 0)])
    run = jax.jit(functools.partial(attn.tree_mla_attention, scale=SCALE))
    check(run(q_lat, q_rope, stack, lens, tail, vis, layer=jnp.int32(2)), (q_lat, q_rope, cache, lens, tail, vis))
