"""tree_mla_attention: reference vs a per-row loop, Pallas kernel (interpret mode) vs reference, sharding,
cuda lowering. Shapes are bucketed (one cache length, a few (T, H) pairs) so compiles are shared."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as plgpu
from jax.sharding import AbstractDevice, AbstractMesh, Mesh, NamedSharding, PartitionSpec, use_abstract_mesh

from k26jax import ddtree
from k26jax.ops import tree_mla_attention_sharded
from pallas_kernels import mla_prefix_mosaic, mla_splits
from pallas_kernels.mla_splits import choose_num_splits, list_schedule_makespan, plan_makespan, plan_splits
from pallas_kernels.tree_mla_attention import merge_groups, tree_mla_attention, tree_mla_attention_reference

R, P = 64, 16  # the tiny model's latent / rope widths
S_MAX = 1000
PREFIX_LENS = [0, 1, 5, 127, 128, 1000]  # one per sequence, C = 6
SCALE = 0.2


def tree_visibility(rng, C, T):
    """[C, T, T] ancestor-or-self relation of random trees with parents[i] < i (node 0 is the root)."""
    parents = [[-1] + [int(rng.integers(0, i)) for i in range(1, T)] for _ in range(C)]
    return np.stack([ddtree.visibility_from_parents(p) for p in parents])


def make_inputs(seed, T, H, *, R=R, P=P, prefix_lens=PREFIX_LENS, S=S_MAX, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    C = len(prefix_lens)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    return (
        normal(C, T, H, R),
        normal(C, T, H, P),
        normal(C, S, R + P),
        jnp.asarray(prefix_lens, jnp.int32),
        normal(C, T, R + P),
        jnp.asarray(tree_visibility(rng, C, T)),
    )


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def loop_reference(q_lat, q_rope, cache, prefix_len, tail, visibility, scale):
    """Row-by-row float64 softmax over the keys each row sees."""
    q_lat, q_rope, cache, tail = (np.asarray(a, np.float64) for a in (q_lat, q_rope, cache, tail))
    C, T, H, R_ = q_lat.shape
    out = np.zeros(q_lat.shape)
    for c in range(C):
        for t in range(T):
            keys = np.concatenate([cache[c, : prefix_len[c]], tail[c][np.asarray(visibility[c, t])]])
            for h in range(H):
                if len(keys):
                    s = (keys[:, :R_] @ q_lat[c, t, h] + keys[:, R_:] @ q_rope[c, t, h]) * scale
                    p = np.exp(s - s.max())
                    out[c, t, h] = p @ keys[:, :R_] / p.sum()
    return out


def test_reference_matches_row_loop():
    args = make_inputs(0, 5, 3, prefix_lens=[0, 3, 17], S=20)
    vis = np.array(args[5])
    vis[0, 2] = False  # a row with no prefix and an empty tree row: defined as 0
    args = (*args[:5], jnp.asarray(vis))
    out = tree_mla_attention_reference(*args, scale=SCALE)
    np.testing.assert_allclose(out, loop_reference(*args, SCALE), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(out[0, 2]) == 0)


@functools.cache
def kernel(**knobs):
    return jax.jit(functools.partial(tree_mla_attention, scale=SCALE, interpret=True, **knobs))


@pytest.mark.parametrize("T,H", [(1, 1), (1, 8), (2, 8), (9, 8), (33, 1), (65, 1), (1, 64), (2, 64)])
def test_kernel_matches_reference_float32(T, H):
    args = make_inputs(T * 100 + H, T, H)
    ref = tree_mla_attention_reference(*args, scale=SCALE)
    out = kernel()(*args)
    assert out.dtype == jnp.float32
    assert rel_err(out, ref) < 1e-5
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "knobs",
    [dict(block_m=16, block_k=16, num_splits=3), dict(block_r=32, num_splits=1), dict(block_k=128, num_splits=7)],
)
def test_kernel_knobs_float32(knobs):
    args = make_inputs(1, 9, 8)
    assert rel_err(kernel(**knobs)(*args), tree_mla_attention_reference(*args, scale=SCALE)) < 1e-5


def test_kernel_k26_widths_bfloat16():
    args = make_inputs(2, 9, 8, R=512, P=64, prefix_lens=[0, 127, 300], S=300, dtype=jnp.bfloat16)
    out = kernel()(*args)
    assert out.dtype == jnp.bfloat16
    ref = tree_mla_attention_reference(
        *(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args), scale=SCALE
    )
    assert rel_err(out, ref) <= 1e-2


def test_large_logits_no_nan():
    q_lat, q_rope, *rest = make_inputs(3, 9, 8)
    args = (q_lat * 300, q_rope * 300, *rest)  # logits of order 1e4
    out = kernel()(*args)
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(out, tree_mla_attention_reference(*args, scale=SCALE)) < 1e-4


def test_rows_seeing_only_themselves():
    q_lat, q_rope, cache, _, tail, _ = make_inputs(4, 9, 8)
    C = cache.shape[0]
    no_prefix = jnp.zeros((C,), jnp.int32)
    only_self = jnp.broadcast_to(jnp.eye(9, dtype=bool), (C, 9, 9))
    out = kernel()(q_lat, q_rope, cache, no_prefix, tail, only_self)
    np.testing.assert_allclose(out, jnp.broadcast_to(tail[:, :, None, :R], out.shape), rtol=1e-6, atol=1e-6)
    nothing = jnp.zeros_like(only_self)  # defined: a row that sees no key outputs 0
    assert np.all(np.asarray(kernel()(q_lat, q_rope, cache, no_prefix, tail, nothing)) == 0)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_sharded_heads_equal_unsharded(impl):
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(1, 8), ("data", "model"))  # as k26jax.sharding.make_mesh
    args = make_inputs(5, 2, 16, prefix_lens=[0, 77], S=100)
    sharded = (
        tree_mla_attention_sharded(mesh, impl=impl, interpret=True)
        if impl == "pallas"
        else tree_mla_attention_sharded(mesh, impl=impl)
    )
    out = jax.jit(functools.partial(sharded, scale=SCALE))(*args)
    assert rel_err(out, tree_mla_attention_reference(*args, scale=SCALE)) < 1e-5


@pytest.mark.parametrize("prefix_lens", [[0, 77, 12, 100], [5, 77, 100]], ids=["batch-over-data", "replicated"])
def test_two_host_layout_splits_the_batch_over_data_where_it_divides(prefix_lens):
    """A (2, 4) ("data", "model") mesh, the two-host layout: 4 sequences go 2 a host (each host attends over its own
    cache rows), 3 stay replicated; a layer stack with a traced layer, the Pallas kernel in interpret mode."""
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    q_lat, q_rope, _, prefix_len, tail, vis = make_inputs(11, 3, 8, prefix_lens=prefix_lens, S=100)
    stack = jnp.asarray(np.random.default_rng(12).standard_normal((2, len(prefix_lens), 100, R + P)), jnp.float32)
    want = tree_mla_attention_reference(q_lat, q_rope, stack[1], prefix_len, tail, vis, scale=SCALE)
    split = len(prefix_lens) % 2 == 0
    if split:  # the cache laid out as k26jax.sharding.cache_partition_spec: batch over "data"
        stack = jax.device_put(stack, NamedSharding(mesh, PartitionSpec(None, "data")))
    sharded = tree_mla_attention_sharded(mesh, impl="pallas", interpret=True)
    run = jax.jit(lambda cache, layer: sharded(q_lat, q_rope, cache, prefix_len, tail, vis, scale=SCALE, layer=layer))
    assert rel_err(run(stack, jnp.int32(1)), want) < 1e-5
    if split:  # each host reads its own sequences' rows: nothing gathers the cache
        assert "all-gather" not in run.lower(stack, jnp.int32(1)).compile().as_text()


def test_layer_of_a_cache_stack_equals_that_layers_cache():
    """cache [L, C, S_max, R+P] with a traced layer index == that layer's own [C, S_max, R+P] cache, for the
    reference, the kernels and the sharded form."""
    q_lat, q_rope, _, prefix_len, tail, vis = make_inputs(8, 3, 8, prefix_lens=[0, 77, 100], S=100)
    stack = jnp.asarray(np.random.default_rng(9).standard_normal((3, 3, 100, R + P)), jnp.float32)
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(1, 8), ("data", "model"))
    forms = {
        "reference": tree_mla_attention_reference,
        "pallas": functools.partial(tree_mla_attention, interpret=True),
        "sharded": tree_mla_attention_sharded(mesh, impl="pallas", interpret=True),
    }
    for name, attention in forms.items():
        run = jax.jit(
            lambda layer, f=attention: f(q_lat, q_rope, stack, prefix_len, tail, vis, scale=SCALE, layer=layer)
        )
        for layer in (1, 2):
            want = tree_mla_attention_reference(q_lat, q_rope, stack[layer], prefix_len, tail, vis, scale=SCALE)
            assert rel_err(run(jnp.int32(layer)), want) < 1e-5, (name, layer)


def test_bad_arguments_raise():
    args = make_inputs(6, 2, 4, prefix_lens=[3], S=8)
    with pytest.raises(ValueError, match="stack"):
        tree_mla_attention_reference(*args, scale=SCALE, layer=0)  # a single layer's cache with layer=
    with pytest.raises(ValueError, match="cache must be"):
        tree_mla_attention(args[0], args[1], args[2][None], *args[3:], scale=SCALE, interpret=True)  # stack, no layer
    with pytest.raises(ValueError, match="tail"):
        tree_mla_attention_reference(*args[:4], args[4][:, :1], args[5], scale=SCALE)
    with pytest.raises(ValueError, match="visibility"):
        tree_mla_attention(*args[:5], args[5].astype(jnp.int32), scale=SCALE, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        tree_mla_attention_reference(args[0][..., :48], *args[1:], scale=SCALE)
    with pytest.raises(ValueError, match="block_k"):
        tree_mla_attention(*args, scale=SCALE, block_k=24, interpret=True)
    with pytest.raises(ValueError, match="impl"):
        tree_mla_attention_sharded(Mesh(np.asarray(jax.devices()[:8]), ("model",)), impl="cuda")


H200 = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
)


@pytest.mark.parametrize(
    "T,H,R_,P_,knobs,mosaic_calls",
    [
        (65, 64, 512, 64, {}, 1),  # verify: Mosaic prefix + tail (auto)
        (129, 8, 512, 64, {}, 1),  # the largest tree: 192 tail rows, 6 bit words
        (65, 64, 512, 64, dict(prefix_kernel="triton"), 0),  # the Triton verify tile: block_m 64, 8 warps
        (1, 64, 512, 64, {}, 1),  # decode, all heads on one GPU
        (5, 64, 512, 64, {}, 1),  # a 5-row tail, read unpadded
        (1, 64, 512, 64, dict(prefix_kernel="triton"), 0),
        (1, 8, 512, 64, {}, 0),  # decode under TP-8: Triton, block_m 16
        (33, 8, 512, 64, dict(block_k=64, block_r=256, num_stages=2, prefix_kernel="triton"), 0),
        (33, 8, 512, 64, {}, 1),  # 264 rows: 5 Mosaic tiles, the last past the end
        (9, 16, 64, 16, {}, 0),  # tiny model widths: Triton only
    ],
)
def test_lowers_for_cuda(T, H, R_, P_, knobs, mosaic_calls):
    C, S = 2, 4096
    bf16 = jnp.bfloat16
    shapes = [
        ((C, T, H, R_), bf16),
        ((C, T, H, P_), bf16),
        ((C, S, R_ + P_), bf16),
        ((C,), jnp.int32),
        ((C, T, R_ + P_), bf16),
        ((C, T, T), jnp.bool_),
    ]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    with use_abstract_mesh(H200):
        hlo = (
            jax.jit(functools.partial(tree_mla_attention, scale=SCALE, **knobs))
            .trace(*args)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    assert hlo.count("@mosaic_gpu_v2(") == mosaic_calls
    assert hlo.count(plgpu.CUSTOM_CALL_TARGET_NAME) == (0 if mosaic_calls else 2)  # Triton prefix and tail kernels


@pytest.mark.parametrize("prefix_kernel", ["triton", "mosaic"])
def test_cache_stack_is_read_in_place(prefix_kernel):
    """With layer=, the kernels get the whole stack (reshaped, not sliced): no per-layer copy of the cache."""
    L, C, T, H, S = 4, 2, 33, 8, 4096
    bf16 = jnp.bfloat16
    shapes = [
        ((C, T, H, 512), bf16),
        ((C, T, H, 64), bf16),
        ((L, C, S, 576), bf16),
        ((C,), jnp.int32),
        ((C, T, 576), bf16),
        ((C, T, T), jnp.bool_),
        ((), jnp.int32),
    ]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    attention = lambda *a: tree_mla_attention(*a[:-1], scale=SCALE, prefix_kernel=prefix_kernel, layer=a[-1])
    with use_abstract_mesh(H200):
        hlo = jax.jit(attention).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "dynamic_slice" not in hlo and "tensor<8x4096x576xbf16>" in hlo  # the [L*C, S, 576] view


@pytest.mark.parametrize(
    "programs,key_blocks,resident,min_split_blocks,want",
    [
        (8, 512, 132, 4, 16),  # C=8 decode at 32K: 128 programs; 17 splits (136) would add a 4-program wave
        (16, 512, 132, 4, 8),
        (1, 512, 132, 4, 128),
        (520, 512, 132, 4, 1),  # C=8 verify, 65 m blocks: already four waves
        (65, 512, 132, 4, 2),  # C=1 verify: 130 programs, not 3 splits (195: two waves)
        (72, 512, 132, 4, 5),  # C=8 verify at 8 heads: 3 waves of 103 blocks beat 5 of 57 (fixed cost a program)
        (1, 2, 132, 4, 1),  # a short cache is not split below 4 key blocks a split
        (1, 16, 264, 1, 16),  # Triton decode at 8 heads (16-row tiles), 1K: one key block a split
        (1, 128, 264, 1, 128),  # ... and 8K at C = 1
        (4, 128, 264, 1, 64),  # ... C = 4: 256 programs, one wave
        (8, 512, 264, 1, 32),  # ... C = 8 at 32K: 33 splits would not shorten a split (16 blocks)
    ],
)
def test_choose_num_splits_avoids_a_mostly_idle_wave(programs, key_blocks, resident, min_split_blocks, want):
    splits = choose_num_splits(programs, key_blocks, resident, min_split_blocks)
    assert splits == want
    assert splits <= max(1, -(-key_blocks // min_split_blocks))
    waves = -(-programs * splits // resident)
    assert programs * splits > (waves - 1) * resident + resident // 2 or waves == 1


def test_list_schedule_makespan():
    assert list_schedule_makespan([], 4) == 0
    assert list_schedule_makespan([5, 5, 5], 2) == 10
    assert list_schedule_makespan([7, 2, 2, 2, 2], 2) == 8  # the short ones fill the slot beside the long one


@pytest.mark.parametrize(
    "m_blocks,C,key_blocks,tail_blocks,most_makespan,uniform_splits",
    [
        (9, 8, 512, 2, 307, None),  # C=8/32K/T=65/H=8: per-sequence counts 3 and 4 model 334, 5 each 357
        (17, 16, 128, 3, 326, None),  # C=16/8K/T=129/H=8: counts 2 and 3 model 366
        (65, 8, 512, 2, 2120, 1),  # C=8 verify at 64 heads: 520 programs, already four waves; one group a sequence
        (1, 1, 12, 1, 21, 3),  # a short cache: equal splits of 4 key blocks (the greedy plan never cuts below 16)
        (1, 8, 128, 1, 25, 15),  # decode at 8K, 64 heads: 15 splits a sequence end as soon as 16, with fewer groups
    ],
)
def test_plan_splits(m_blocks, C, key_blocks, tail_blocks, most_makespan, uniform_splits):
    """The plan is valid, never models slower than `choose_num_splits`'s equal splits, and meets the makespan its
    model found when it was written (equal splits, sequence after sequence, where uniform_splits is given)."""
    plan = plan_splits(m_blocks, C, key_blocks, tail_blocks, 132)
    assert mla_splits.check_plan(plan, C, key_blocks) == plan
    equal = mla_splits.equal_plan(choose_num_splits(C * m_blocks, key_blocks, 132), C, key_blocks)
    makespan = plan_makespan(plan, m_blocks, tail_blocks, 132)
    assert makespan <= min(most_makespan, plan_makespan(equal, m_blocks, tail_blocks, 132))
    if uniform_splits:
        assert plan == mla_splits.equal_plan(uniform_splits, C, key_blocks)
    else:
        last = {c: g for g, (c, _, _) in enumerate(plan)}  # a last group may hold less: the rest, and the tail
        assert all(end - first >= 16 for g, (c, first, end) in enumerate(plan) if g != last[c])


UNEQUAL_COUNTS = ((2, 0, 10), (0, 0, 47), (3, 0, 30), (2, 10, 11), (1, 0, 20), (3, 30, 47), (2, 11, 47), (1, 20, 47))
EQUAL_COUNTS = ((3, 0, 30), (1, 0, 20), (0, 0, 10), (2, 0, 5), (2, 5, 47), (0, 10, 47), (1, 20, 47), (3, 30, 47))


@pytest.mark.parametrize("plan", [UNEQUAL_COUNTS, EQUAL_COUNTS])
@pytest.mark.parametrize("T,H,prefix_lens", [(2, 32, [0, 64, 100, 2000]), (1, 64, [3000, 1, 2048, 2047])])
def test_merge_of_an_interleaved_plan(T, H, prefix_lens, plan):
    """merge_groups reads each sequence's partials at their slots, wherever the plan launches its groups, into the
    exact merge (group counts 1, 2, 3 and 2, or 2 each); checked on the float32 reference partials against the
    whole reference (ragged and empty prefixes, odd splits)."""
    q_lat, q_rope, cache, prefix_len, tail, vis = make_inputs(9, T, H, R=512, P=64, prefix_lens=prefix_lens, S=3008)
    M = T * H
    tail_visible = jnp.repeat(vis, H, axis=1)
    o, lse = mla_prefix_mosaic.mla_prefix_reference(
        q_lat.reshape(4, M, 512),
        q_rope.reshape(4, M, 64),
        cache,
        prefix_len,
        tail,
        tail_visible,
        plan=plan,
        qk_scale=0.3,
    )
    merged = merge_groups(o, lse, plan, 4).reshape(4, T, H, 512)
    want = tree_mla_attention_reference(q_lat, q_rope, cache, prefix_len, tail, vis, scale=0.3 / np.log2(np.e))
    assert rel_err(merged, want) < 1e-5
