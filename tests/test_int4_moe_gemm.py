"""pallas_kernels.int4_moe_gemm: interpret mode against the jnp reference, layout, sharding, cuda lowering."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as plgpu
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from k26jax import ops, sharded_kernels
from pallas_kernels import int4_moe_common
from pallas_kernels import int4_moe_gemm as moe

H200 = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
)


def pack_int4(q, axis):
    """Independent numpy packer in the compressed-tensors convention: q in [-8, 7] -> int32 words along
    `axis`, nibble k of word j = q[8j + k] + 8 (LSB first)."""
    q = np.moveaxis(np.asarray(q), axis, -1)
    u = (q + 8).astype(np.uint32).reshape(*q.shape[:-1], -1, 8)
    words = np.zeros(u.shape[:-1], np.uint32)
    for k in range(8):
        words |= u[..., k] << (4 * k)
    return np.moveaxis(words.view(np.int32), -1, axis)


def random_experts(seed, num_experts, d, i, extremes=False):
    """Packed experts and their dense float64 values; extremes=True uses only q in {-8, 7}."""
    rng = np.random.default_rng(seed)
    draw = (lambda shape: rng.choice([-8, 7], shape)) if extremes else (lambda shape: rng.integers(-8, 8, shape))
    q13, q2 = draw((num_experts, d, 2, i)), draw((num_experts, i, d))
    s13 = jnp.asarray(rng.uniform(0.5, 1.5, (num_experts, d // 32, 2, i)) / (4 * d**0.5), jnp.bfloat16)
    s2 = jnp.asarray(rng.uniform(0.5, 1.5, (num_experts, i // 32, d)) / (4 * i**0.5), jnp.bfloat16)
    packed = (jnp.asarray(pack_int4(q13, 1)), s13, jnp.asarray(pack_int4(q2, 1)), s2)
    return packed, (q13, q2)


def random_routing(seed, num_tokens, top_k, num_ids):
    """Distinct ids per token drawn from [0, num_ids) (ids >= E are off-shard), weights in (0, 1)."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(num_ids, top_k, replace=False) for _ in range(num_tokens)]).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(rng.uniform(0.1, 1.0, (num_tokens, top_k)), jnp.float32)


def rel_err(y, y_ref):
    y, y_ref = np.asarray(y, np.float64), np.asarray(y_ref, np.float64)
    return np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref)


@functools.lru_cache(maxsize=None)
def small_experts():
    return random_experts(0, num_experts=8, d=256, i=256)


def test_unpack_matches_independent_packer():
    rng = np.random.default_rng(1)
    q = rng.integers(-8, 8, (3, 64, 5))
    for axis in (1, -2):
        np.testing.assert_array_equal(moe.unpack_int4(jnp.asarray(pack_int4(q, 1)), axis), q)
    # Worked example of compressed-tensors pack-quantized (reference/k26_architecture.md section 4).
    word = jnp.asarray([np.uint32(0xB6A1F879).view(np.int32)])
    np.testing.assert_array_equal(moe.unpack_int4(word, 0), [1, -1, 0, 7, -7, 2, -2, 3])


def test_dequantize_rounds_once_to_bf16():
    rng = np.random.default_rng(2)
    q = rng.integers(-8, 8, (64, 3))
    scale = jnp.asarray(rng.uniform(-2, 2, (2, 3)), jnp.bfloat16)
    expected = (q.astype(np.float32) * np.repeat(np.asarray(scale, np.float32), 32, axis=0)).astype(jnp.bfloat16)
    got = jax.jit(moe.dequantize_int4, static_argnums=(2, 3))(jnp.asarray(pack_int4(q, 0)), scale, 0, jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected, np.float32))


def test_reference_matches_float64_loop():
    (packed, (q13, q2)) = small_experts()
    x = np.random.default_rng(3).normal(size=(5, 256))
    ids, weights = random_routing(4, 5, 3, num_ids=10)  # ids 8 and 9 are off this (unsharded) set
    y = moe.fused_moe_reference(jnp.asarray(x, jnp.float32), ids, weights, *packed)
    bf16_round = lambda v: np.asarray(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16), np.float64)
    w13 = bf16_round(q13 * np.repeat(np.asarray(packed[1], np.float64), 32, axis=1))
    w2 = bf16_round(q2 * np.repeat(np.asarray(packed[3], np.float64), 32, axis=1))
    y64 = np.zeros_like(x)
    for m in range(5):
        for j in range(3):
            e = int(ids[m, j])
            if e < 8:
                gate, up = x[m] @ w13[e, :, 0], x[m] @ w13[e, :, 1]
                y64[m] += float(weights[m, j]) * ((gate / (1 + np.exp(-gate)) * up) @ w2[e])
    assert rel_err(y, y64) < 1e-5


def test_sort_routing_pads_every_group_to_block_multiples():
    ids, _ = random_routing(5, 37, 4, num_ids=11)
    local = ids.reshape(-1) - 2  # an EP shard owning experts [2, 10): ids 0, 1 and 10 are off-shard
    block_m = 16
    block_expert, slot_pair = jax.jit(moe.sort_routing, static_argnums=(1, 2))(local, 8, block_m)
    block_expert, slot_pair = np.asarray(block_expert), np.asarray(slot_pair)
    assert slot_pair.shape == (block_expert.shape[0] * block_m,)
    local = np.asarray(local)
    on_shard = np.flatnonzero((local >= 0) & (local < 8))
    np.testing.assert_array_equal(np.sort(slot_pair[slot_pair >= 0]), on_shard)  # each pair exactly once
    for b, expert in enumerate(block_expert):
        rows = slot_pair[b * block_m : (b + 1) * block_m]
        if expert < 0:
            assert (rows < 0).all()
        else:
            assert (rows >= 0).any() and (local[rows[rows >= 0]] == expert).all()
    used = block_expert[block_expert >= 0]
    assert (np.diff(used) >= 0).all() and (block_expert[len(used) :] < 0).all()  # sorted, unused blocks last
    assert all((np.diff(rows[rows >= 0]) > 0).all() for rows in slot_pair.reshape(-1, block_m))  # pair order


@pytest.mark.parametrize("num_pairs,chunk", [(0, 1024), (1, 1024), (7, 1024), (300, 64), (2500, 1024)])
def test_expert_ranks_are_a_stable_argsort_by_expert(num_pairs, chunk):
    """Counts and ranks without a sort, across chunk boundaries and ragged last chunks, against numpy."""
    local = np.random.default_rng(num_pairs).integers(-2, 10, num_pairs).astype(np.int32)  # 8 experts
    counts, rank = jax.jit(int4_moe_common.expert_ranks, static_argnums=(1, 2))(jnp.asarray(local), 8, chunk)
    key = np.where((local >= 0) & (local < 8), local, 8)
    order = np.argsort(key, kind="stable")
    want_rank = np.empty(num_pairs, np.int64)
    want_rank[order] = np.arange(num_pairs) - np.searchsorted(key[order], key[order])
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(key, minlength=9)[:8])
    np.testing.assert_array_equal(np.asarray(rank), want_rank)


def test_fit_tiling_divides_dims_and_rejects_what_cannot():
    tiling = moe.fit_tiling(moe.Tiling(block_n_gate_up=128, block_n_down=256, block_kw_gate_up=64), 7168, 2048)
    assert tiling.block_n_down == 256 and tiling.block_n_gate_up == 128 and tiling.block_kw_gate_up == 64
    shrunk = moe.fit_tiling(moe.Tiling(block_n_down=256, block_kw_gate_up=32), 1152, 2048)  # 1152 = 9 * 128
    assert (shrunk.block_n_down, shrunk.block_kw_gate_up) == (128, 16)
    with pytest.raises(ValueError, match="I/8"):
        moe.fit_tiling(moe.Tiling(), 256, 64)  # 8 packed rows: no power-of-two K block >= 16 divides them


SMALL_CASES = [  # (M, top_k, per_pair, block_m, split_k_down, n_fastest, swap_ab, dtype)
    (1, 2, True, 16, 1, False, False, jnp.float32),
    (3, 3, True, 16, 2, True, False, jnp.float32),
    (17, 3, False, 16, 1, False, False, jnp.float32),
    (64, 2, False, 32, 2, True, False, jnp.float32),
    (300, 2, False, 16, 1, True, False, jnp.float32),
    (17, 4, False, 16, 1, False, False, jnp.bfloat16),
    (3, 3, True, 16, 1, True, True, jnp.float32),
    (64, 2, False, 32, 2, True, True, jnp.float32),
    (300, 2, False, 64, 1, True, True, jnp.float32),
    (17, 4, False, 16, 1, False, True, jnp.bfloat16),
]


@pytest.mark.parametrize("num_tokens,top_k,per_pair,block_m,split_k,n_fastest,swap_ab,dtype", SMALL_CASES)
def test_fused_moe_interpret_matches_reference(
    num_tokens, top_k, per_pair, block_m, split_k, n_fastest, swap_ab, dtype
):
    packed, _ = small_experts()
    x = jnp.asarray(np.random.default_rng(num_tokens).normal(size=(num_tokens, 256)), dtype)
    ids, weights = random_routing(num_tokens + 1, num_tokens, top_k, num_ids=10)  # ragged, 8..9 off-set
    tiling = moe.Tiling(
        block_m=block_m,
        per_pair=per_pair,
        split_k_down=split_k,
        block_n_gate_up=64,
        block_n_down=64,
        n_fastest=n_fastest,
        swap_ab=swap_ab,
        dequant="f32",
    )
    y = moe.fused_moe(x, ids, weights, *packed, tiling=tiling, interpret=True)
    y_ref = moe.fused_moe_reference(x, ids, weights, *packed)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, y_ref) < (1e-5 if dtype == jnp.float32 else 1e-2)


def test_experts_with_zero_tokens_and_all_off_shard_rows():
    packed, _ = small_experts()
    x = jnp.asarray(np.random.default_rng(6).normal(size=(9, 256)), jnp.float32)
    ids = jnp.asarray(np.array([[1, 2]] * 4 + [[1, 9]] * 3 + [[8, 9]] * 2, np.int32))  # experts 0, 3..7 idle
    weights = jnp.full(ids.shape, 0.5, jnp.float32)
    for per_pair in (False, True):
        tiling = moe.Tiling(per_pair=per_pair, block_n_gate_up=64, block_n_down=64, dequant="f32")
        y = moe.fused_moe(x, ids, weights, *packed, tiling=tiling, interpret=True)
        assert rel_err(y, moe.fused_moe_reference(x, ids, weights, *packed)) < 1e-5
        np.testing.assert_array_equal(np.asarray(y[-2:]), 0.0)  # both ids off-shard: exactly zero


def test_real_dims_few_experts_extreme_values():
    """D=7168, I=2048 with 2 experts whose weights are all -8 or 7; one pair-per-block and one sorted case."""
    packed, _ = random_experts(7, num_experts=2, d=7168, i=2048, extremes=True)
    x = jnp.asarray(np.random.default_rng(8).normal(size=(3, 7168)), jnp.float32)
    ids = jnp.asarray([[0, 1], [1, 0], [1, 2]], jnp.int32)
    weights = jnp.asarray([[0.7, 0.3], [0.5, 0.5], [1.0, 0.2]], jnp.float32)
    y_ref = moe.fused_moe_reference(x, ids, weights, *packed)
    big = dict(block_n_gate_up=512, block_n_down=1024, block_kw_gate_up=128, block_kw_down=128, dequant="f32")
    for per_pair in (True, False):
        y = moe.fused_moe(x, ids, weights, *packed, tiling=moe.Tiling(per_pair=per_pair, **big), interpret=True)
        assert rel_err(y, y_ref) < 1e-5


def test_bad_arguments_name_the_argument():
    packed, _ = small_experts()
    x = jnp.zeros((4, 256), jnp.float32)
    ids, weights = random_routing(9, 4, 2, num_ids=8)
    with pytest.raises(ValueError, match="w2_scale"):
        moe.fused_moe(x, ids, weights, *packed[:3], packed[3][:, :4], interpret=True)
    with pytest.raises(ValueError, match="topk_weights"):
        moe.fused_moe_reference(x, ids, weights[:, :1], *packed)
    with pytest.raises(ValueError, match="x must be"):
        moe.fused_moe(x.astype(jnp.float16), ids, weights, *packed, interpret=True)
    with pytest.raises(ValueError, match="asm"):
        moe.fused_moe(x, ids, weights, *packed, tiling=moe.Tiling(dequant="asm"), interpret=True)


@pytest.mark.parametrize("mode", ["ep", "tp", "ep_global"])
def test_sharded_forms_equal_unsharded_reference(mode):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    packed, _ = random_experts(10, num_experts=8, d=256, i=1024)  # TP: I/4 = 256 per shard
    x = jnp.asarray(np.random.default_rng(11).normal(size=(6, 256)), jnp.float32)
    ids, weights = random_routing(12, 6, 3, num_ids=8)
    y_ref = moe.fused_moe_reference(x, ids, weights, *packed)
    specs = sharded_kernels.moe_specs(mode)
    args = [
        jax.device_put(a, jax.sharding.NamedSharding(mesh, spec)) for a, spec in zip((x, ids, weights, *packed), specs)
    ]
    tiling = moe.Tiling(block_n_gate_up=64, block_n_down=64, dequant="f32")
    for impl in ("reference", "pallas"):
        f = ops.fused_moe_sharded(mesh, mode=mode, impl=impl, interpret=True, tiling=tiling)
        assert rel_err(jax.jit(f)(*args), y_ref) < 1e-5


def _lower_for_cuda(num_tokens, tiling, dtype=jnp.bfloat16):
    """Lowers the wrapper for an H200 with K2.6 shapes; returns the number of Triton custom calls."""
    e, d, i = 384, 7168, 2048
    args = (
        jax.ShapeDtypeStruct((num_tokens, d), dtype),
        jax.ShapeDtypeStruct((num_tokens, 8), jnp.int32),
        jax.ShapeDtypeStruct((num_tokens, 8), jnp.float32),
        jax.ShapeDtypeStruct((e, d // 8, 2, i), jnp.int32),
        jax.ShapeDtypeStruct((e, d // 32, 2, i), jnp.bfloat16),
        jax.ShapeDtypeStruct((e, i // 8, d), jnp.int32),
        jax.ShapeDtypeStruct((e, i // 32, d), jnp.bfloat16),
    )
    with use_abstract_mesh(H200):
        hlo = (
            jax.jit(functools.partial(moe.fused_moe, tiling=tiling))
            .trace(*args)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    return hlo.count(plgpu.CUSTOM_CALL_TARGET_NAME)


@pytest.mark.parametrize("num_tokens", [1, 16, 1024, 4096])  # one M for each tiling choose_tiling returns
def test_every_default_tiling_lowers_for_cuda(num_tokens):
    for dtype in (jnp.bfloat16, jnp.float32):
        tiling = moe.choose_tiling(num_tokens, 8, dtype)
        assert tiling.dequant == ("asm" if dtype == jnp.bfloat16 else "f32")
        assert _lower_for_cuda(num_tokens, tiling, dtype) == 2


@pytest.mark.parametrize(
    "variant",
    [
        dict(split_k_down=2),
        dict(n_fastest=True),
        dict(n_fastest=False),
        dict(swap_ab=True),
        dict(swap_ab=True, block_m=64, block_kw_gate_up=16),
    ],
)
def test_tiling_variants_lower_for_cuda(variant):
    tiling = dataclasses.replace(moe.choose_tiling(64, 8), **variant)
    assert _lower_for_cuda(64, tiling) == 2


def test_stacked_weights_with_layer_index_equal_that_layers_experts():
    """Weights stacked per layer ([n, E, ...]) with a traced layer index == that layer's own [E, ...] weights."""
    layers = [random_experts(seed, num_experts=8, d=256, i=256)[0] for seed in (11, 12, 13)]
    stacked = tuple(jnp.stack(ws) for ws in zip(*layers))
    x = jnp.asarray(np.random.default_rng(8).normal(size=(5, 256)), jnp.float32)
    ids, weights = random_routing(9, 5, 2, 10)  # ids 8, 9 are off-shard
    for layer in range(3):
        y_ref = moe.fused_moe_reference(x, ids, weights, *layers[layer])
        for per_pair in (False, True):
            tiling = moe.Tiling(per_pair=per_pair, block_n_gate_up=64, block_n_down=64, dequant="f32")
            y = jax.jit(functools.partial(moe.fused_moe, tiling=tiling, interpret=True))(
                x, ids, weights, *stacked, layer=jnp.int32(layer)
            )
            assert rel_err(y, y_ref) < 1e-5
        assert rel_err(moe.fused_moe_reference(x, ids, weights, *stacked, layer=jnp.int32(layer)), y_ref) < 1e-6


def test_stacked_form_lowers_for_cuda():
    n, e, d, i = 3, 384, 7168, 2048
    args = (
        jax.ShapeDtypeStruct((16, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((16, 8), jnp.int32),
        jax.ShapeDtypeStruct((16, 8), jnp.float32),
        jax.ShapeDtypeStruct((n, e, d // 8, 2, i), jnp.int32),
        jax.ShapeDtypeStruct((n, e, d // 32, 2, i), jnp.bfloat16),
        jax.ShapeDtypeStruct((n, e, i // 8, d), jnp.int32),
        jax.ShapeDtypeStruct((n, e, i // 32, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((), jnp.int32),
    )
    with use_abstract_mesh(H200):
        tiling = moe.choose_tiling(16, 8)  # the Triton kernels (the default at 16 tokens is Mosaic's, tested there)
        hlo = (
            jax.jit(lambda *a: moe.fused_moe(*a[:-1], layer=a[-1], tiling=tiling))
            .trace(*args)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    assert hlo.count(plgpu.CUSTOM_CALL_TARGET_NAME) == 2
    assert "dynamic_slice" not in hlo  # the stack is not sliced per layer


def test_n_fastest_keeps_row_blocks_on_the_unbounded_grid_axis():
    assert moe._grid(600, 32, True)[0] == (32, 600)
    assert moe._grid(70000, 32, True)[0] == (70000, 32)  # > 65535 row blocks (a long prefill)
    assert moe._grid(70000, 56, True, 2)[0] == (70000, 56, 2)
