"""pallas_kernels.int4_moe_mosaic: the register mapping of the PTX dequant (numpy emulation), interpret mode
against the jnp reference, bad input, cuda lowering. (The PTX itself runs only on the GPU: bench_moe_gemm.py
checks every case against the reference there.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from k26jax import ops, sharded_kernels
from pallas_kernels import int4_moe_common
from pallas_kernels import int4_moe_gemm as moe
from pallas_kernels import int4_moe_mosaic as mosaic
from tests.test_int4_moe_gemm import random_experts, random_routing, rel_err

H200 = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
)


def bf16_product(q, scale):
    return np.asarray(jnp.asarray(np.float32(q) * np.float32(scale), jnp.bfloat16).astype(jnp.float32))


def emulate_ptx_fragment(words_NW, scales_GN, chunk):
    """What `_dequant_chunk` leaves in each thread's registers, placed at the wgmma A coordinates PTX defines.

    words_NW int32 [64 cols, 32 words], scales_GN [8 groups, 64 cols] -> float32 [64, 64]. Thread t (warp t//32,
    lane l) holds rows r = 16 warp + l//4 and r + 8 and words 8 chunk + 2q + e (q = l % 4); its register
    (k8 block 2i + e, row half) = (nibble i, nibble i + 4) of word e, at A columns 8(2i + e) + 2q and + 1."""
    a = np.full((64, mosaic.CHUNK), np.nan, np.float32)
    u = words_NW.view(np.uint32)
    for t in range(128):
        lane, q = t % 32, t % 4
        for half in range(2):
            row = 16 * (t // 32) + lane // 4 + 8 * half
            scale = scales_GN[2 * chunk + (1 if t & 2 else 0), row]
            for e in range(2):
                word = int(u[row, 8 * chunk + 2 * q + e])
                for i in range(4):
                    lo, hi = (word >> (4 * i)) & 0xF, (word >> (4 * i + 16)) & 0xF
                    col = 8 * (2 * i + e) + 2 * q
                    a[row, col], a[row, col + 1] = bf16_product(lo - 8, scale), bf16_product(hi - 8, scale)
    return a


def test_ptx_fragment_is_the_p1_permuted_weight_tile():
    """The registers the kernel builds are exactly W[n, 64 chunk + P1[k]] (its interpret twin agrees), so the
    product with P1-permuted activations equals the plain product."""
    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31, (64, 32), dtype=np.int64).astype(np.int32)
    scales = np.asarray(jnp.asarray(rng.uniform(0.5, 2.0, (8, 64)), jnp.bfloat16).astype(jnp.float32))
    nibbles = (words.view(np.uint32)[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 0xF  # [n, word, k]
    q_NK = nibbles.reshape(64, 256).astype(np.int64) - 8  # input 8j + k = nibble k of word j
    for chunk in range(4):
        inputs = 64 * chunk + mosaic.P1
        expected = bf16_product(q_NK[:, inputs], scales[inputs // 32, np.arange(64)[:, None]])
        fragment = emulate_ptx_fragment(words, scales, chunk)
        np.testing.assert_array_equal(fragment, expected)
        twin = mosaic._dequant_chunk_jnp(jnp.asarray(words), jnp.asarray(scales, jnp.bfloat16), chunk)
        np.testing.assert_array_equal(np.asarray(twin.astype(jnp.float32)), expected)
    x = rng.normal(size=(3, 256)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(mosaic.to_p1_order(jnp.asarray(x)))[:, 64 + 5], x[:, 64 + mosaic.P1[5]])
    assert sorted(mosaic.P1) == list(range(64))


def mosaic_moe(**kw):
    return jax.jit(functools.partial(mosaic.fused_moe_mosaic, interpret=True, num_sms=3, **kw))


def close(y, y_ref):
    """bf16 h and a different fp32 summation order than XLA's dots flip a few bf16 roundings of h: <= 3e-6 here.
    A wrong scale group, nibble or permutation anywhere gives > 1e-2."""
    return rel_err(y, y_ref) < 1e-4


@pytest.mark.parametrize("num_tokens,top_k,block_m", [(1, 2, 16), (17, 2, 32), (40, 4, 16), (24, 8, 64), (101, 4, 32)])
def test_interpret_matches_reference(num_tokens, top_k, block_m):
    """Ragged groups (8 experts; at small M most get no token) and ids past the 8 local experts (off-shard);
    between them every wgmma width of 16- and 32-row blocks and two of 64-row blocks. float32 output, so the
    final bf16 rounding does not hide errors."""
    experts, _ = random_experts(1, num_experts=8, d=512, i=256)
    x = jnp.asarray(np.random.default_rng(num_tokens).normal(size=(num_tokens, 512)), jnp.bfloat16)
    ids, weights = random_routing(num_tokens, num_tokens, top_k, 10)
    y_ref = moe.fused_moe_reference(x, ids, weights, *experts, out_dtype=jnp.float32)
    assert close(
        mosaic_moe(block_m=block_m, out_dtype=jnp.float32, pair_rows_fp32=True)(x, ids, weights, *experts), y_ref
    )


def test_default_rounds_each_pairs_row_to_bf16():
    """Without pair_rows_fp32 each (token, expert) row is rounded to bf16 before the fp32 top-k sum: within a
    bf16 rounding of the fp32-row result, and not equal to it."""
    experts, _ = random_experts(2, num_experts=8, d=512, i=256)
    x = jnp.asarray(np.random.default_rng(7).normal(size=(21, 512)), jnp.bfloat16)
    ids, weights = random_routing(3, 21, 4, 8)
    y_fp32_rows = mosaic_moe(block_m=16, out_dtype=jnp.float32, pair_rows_fp32=True)(x, ids, weights, *experts)
    y = mosaic_moe(block_m=16, out_dtype=jnp.float32)(x, ids, weights, *experts)
    assert 1e-5 < rel_err(y, y_fp32_rows) < 4e-3


def test_extreme_values_stacked_layers_and_expert_offset():
    """q in {-8, 7}; weights stacked per layer and indexed in place; ids offset as an expert-parallel shard."""
    layers = [random_experts(seed, num_experts=4, d=512, i=256, extremes=True)[0] for seed in (5, 6)]
    stacked = tuple(jnp.stack(ws) for ws in zip(*layers))
    x = jnp.asarray(np.random.default_rng(3).normal(size=(9, 512)), jnp.bfloat16)
    ids, weights = random_routing(4, 9, 2, 12)
    for layer in range(2):
        y_ref = moe.fused_moe_reference(x, ids, weights, *layers[layer], expert_offset=4, out_dtype=jnp.float32)
        moe_fn = mosaic_moe(block_m=16, out_dtype=jnp.float32, pair_rows_fp32=True)
        y = moe_fn(x, ids, weights, *stacked, expert_offset=4, layer=jnp.int32(layer))
        assert close(y, y_ref)


def test_bad_arguments_are_named():
    experts, _ = random_experts(1, num_experts=2, d=512, i=256)
    ids, weights = random_routing(0, 2, 1, 2)
    with pytest.raises(ValueError, match="bf16 x"):
        mosaic.fused_moe_mosaic(jnp.zeros((2, 512), jnp.float32), ids, weights, *experts)
    with pytest.raises(ValueError, match="block_m"):
        mosaic.fused_moe_mosaic(jnp.zeros((2, 512), jnp.bfloat16), ids, weights, *experts, block_m=8)
    for width_step in (12, 24):  # not a wgmma width; does not divide the block (rows past 48 would be dropped)
        with pytest.raises(ValueError, match="width_step"):
            mosaic.fused_moe_mosaic(
                jnp.zeros((2, 512), jnp.bfloat16), ids, weights, *experts, block_m=64, width_step=width_step
            )
    small, _ = random_experts(1, num_experts=2, d=128, i=256)
    with pytest.raises(ValueError, match="D=128"):
        mosaic.fused_moe_mosaic(jnp.zeros((2, 128), jnp.bfloat16), ids, weights, *small)


def test_register_split_fits_the_launch_allocation():
    """setmaxnreg moves registers within what the CTA got at launch; asking for more hangs the GPU (the
    interpreter ignores register counts, so only this arithmetic guards it)."""
    threads = 128 * (mosaic.NUM_COMPUTE + 1)
    assert mosaic.LAUNCH_REGISTERS * threads <= 65536
    per_warpgroup = mosaic.NUM_COMPUTE * mosaic.COMPUTE_REGISTERS + mosaic.MEMORY_REGISTERS
    assert per_warpgroup <= (mosaic.NUM_COMPUTE + 1) * mosaic.LAUNCH_REGISTERS
    assert all(24 <= r <= 256 and r % 8 == 0 for r in (mosaic.COMPUTE_REGISTERS, mosaic.MEMORY_REGISTERS))


@pytest.mark.parametrize("block_m,stacked", [(16, False), (32, True), (64, False)])
def test_lowers_for_cuda(block_m, stacked):
    """K2.6 shapes for an H200: Mosaic lays out and lowers both kernels (register layouts, TMA boxes, shared
    memory budget) without a GPU."""
    e, d, i, lead = 384, 7168, 2048, (3,) if stacked else ()
    args = [
        jax.ShapeDtypeStruct((1024, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((1024, 8), jnp.int32),
        jax.ShapeDtypeStruct((1024, 8), jnp.float32),
        jax.ShapeDtypeStruct(lead + (e, d // 8, 2, i), jnp.int32),
        jax.ShapeDtypeStruct(lead + (e, d // 32, 2, i), jnp.bfloat16),
        jax.ShapeDtypeStruct(lead + (e, i // 8, d), jnp.int32),
        jax.ShapeDtypeStruct(lead + (e, i // 32, d), jnp.bfloat16),
    ]
    layer = dict(layer=jax.ShapeDtypeStruct((), jnp.int32)) if stacked else {}
    with use_abstract_mesh(H200):
        hlo = (
            jax.jit(functools.partial(mosaic.fused_moe_mosaic, block_m=block_m, num_sms=132))
            .trace(*args, **layer)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    assert hlo.count("@mosaic_gpu_v2(") == 2
    assert "dynamic_slice" not in hlo  # a stacked layer is indexed inside the kernels


@pytest.mark.parametrize("num_tokens,block_m", [(1, 16), (37, 16), (300, 32), (64, 64)])
def test_gate_up_rows_are_tile_aligned_and_hold_each_slots_token(num_tokens, block_m):
    """TMA rounds an unaligned start row down to its 8-row tile (interpret mode does not), so every block's
    window must start at a multiple of 8, and row block_row[b] + r must hold the token of slot b * block_m + r."""
    ids, _ = random_routing(num_tokens, num_tokens, 4, 10)  # 8 local experts, ids 8 and 9 off-shard
    local_ids = ids.reshape(-1)
    ranks = int4_moe_common.expert_ranks(local_ids, 8)
    route = moe.sort_routing(local_ids, 8, block_m)
    token_of_row, block_row = (
        np.asarray(a) for a in mosaic.gate_up_rows(local_ids, *ranks, route.block_expert, block_m, 4)
    )
    ops = mosaic.routed_operands(jnp.zeros((num_tokens, 256), jnp.bfloat16), local_ids, 8, block_m, 4)
    pair_slot = np.asarray(ops.pair_slot)
    slots = np.flatnonzero(np.asarray(route.slot_pair) >= 0)
    np.testing.assert_array_equal(pair_slot[np.asarray(route.slot_pair)[slots]], slots)  # the combine's rows
    assert np.all(pair_slot[np.asarray(local_ids) >= 8] == -1)
    used = np.asarray(route.block_expert) >= 0
    assert token_of_row.shape[0] % 8 == 0 and np.all(block_row[used] % 8 == 0)
    slot_pair = np.asarray(route.slot_pair).reshape(-1, block_m)
    np.testing.assert_array_equal(np.asarray(ops.block_rows), np.sum(slot_pair >= 0, axis=1))  # sets the wgmma width
    for b in np.flatnonzero(used):
        assert block_row[b] + block_m <= token_of_row.shape[0]
        valid = slot_pair[b] >= 0
        np.testing.assert_array_equal(
            token_of_row[block_row[b] : block_row[b] + block_m][valid], slot_pair[b][valid] // 4
        )
    assert np.sum(token_of_row >= 0) == np.sum(np.asarray(local_ids) < 8)


@pytest.mark.parametrize("num_tokens", [1, 2, 1024, 4096])
def test_wrapper_default_picks_mosaic_for_bf16(num_tokens):
    """int4_moe_gemm.fused_moe with no tiling: the Mosaic kernels for bf16 at every M (they won the H200 races
    from M = 1); float32 and interpret mode take Triton."""
    e, d, i = 384, 7168, 2048
    args = (
        jax.ShapeDtypeStruct((num_tokens, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((num_tokens, 8), jnp.int32),
        jax.ShapeDtypeStruct((num_tokens, 8), jnp.float32),
        jax.ShapeDtypeStruct((e, d // 8, 2, i), jnp.int32),
        jax.ShapeDtypeStruct((e, d // 32, 2, i), jnp.bfloat16),
        jax.ShapeDtypeStruct((e, i // 8, d), jnp.int32),
        jax.ShapeDtypeStruct((e, i // 32, d), jnp.bfloat16),
    )
    with use_abstract_mesh(H200):
        hlo = jax.jit(moe.fused_moe).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert hlo.count("@mosaic_gpu_v2(") == 2
    assert moe.mosaic_block_m(num_tokens, jnp.float32, d, i) is None
    assert moe.mosaic_block_m(num_tokens, jnp.bfloat16, d, i, interpret=True) is None


@pytest.mark.parametrize("mode", ["ep", "tp"])
def test_sharded_forms_lower_with_the_mosaic_kernels(mode):
    """Under shard_map over 8 abstract H200s, experts split (48 a device) or I split (256 a device), M = 1024:
    each shard's default takes the Mosaic kernels and they lower; down's pair rows are bf16 under EP and fp32
    under TP, where they are partial sums over the split I."""
    mesh = AbstractMesh(
        (8,), ("model",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    )
    n, e, d, i, m = 2, 384, 7168, 2048, 1024
    shapes = (
        (m, d),
        (m, 8),
        (m, 8),
        (n, e, d // 8, 2, i),
        (n, e, d // 32, 2, i),
        (n, e, i // 8, d),
        (n, e, i // 32, d),
        (),
    )
    dtypes = (jnp.bfloat16, jnp.int32, jnp.float32, jnp.int32, jnp.bfloat16, jnp.int32, jnp.bfloat16, jnp.int32)
    specs = sharded_kernels.moe_specs(mode, stacked=True) + (jax.sharding.PartitionSpec(),)
    args = [
        jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, spec))
        for shape, dtype, spec in zip(shapes, dtypes, specs)
    ]
    with use_abstract_mesh(mesh):
        hlo = (
            jax.jit(ops.fused_moe_sharded(mesh, mode=mode, stacked=True))
            .trace(*args)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    calls = [line for line in hlo.splitlines() if "@mosaic_gpu_v2(" in line]
    assert len(calls) == 2
    assert f"x{d}x{'f32' if mode == 'tp' else 'bf16'}>" in calls[1].split("->")[-1]


def test_gpus_without_wgmma_keep_to_the_triton_kernels(monkeypatch):
    """Ampere, Ada and Blackwell have no wgmma: the MoE default and the attention's "auto" prefix kernel must not
    pick a Mosaic kernel there (it would fail to compile); Hopper (9.x) and abstract devices may."""
    from types import SimpleNamespace

    from pallas_kernels import arch
    from pallas_kernels.tree_mla_attention import tree_mla_attention

    assert arch.has_wgmma(SimpleNamespace(compute_capability="9.0"))
    assert not any(arch.has_wgmma(SimpleNamespace(compute_capability=cc)) for cc in ("8.0", "8.9", "10.0", "12.0"))
    assert arch.has_wgmma(SimpleNamespace()) and moe.mosaic_block_m(1024, jnp.bfloat16, 7168, 2048) == 32
    monkeypatch.setattr(arch, "has_wgmma", lambda device=None: False)
    assert moe.mosaic_block_m(1024, jnp.bfloat16, 7168, 2048) is None
    shapes = [
        ((2, 65, 64, 512), jnp.bfloat16),
        ((2, 65, 64, 64), jnp.bfloat16),
        ((2, 4096, 576), jnp.bfloat16),
        ((2,), jnp.int32),
        ((2, 65, 576), jnp.bfloat16),
        ((2, 65, 65), jnp.bool_),
    ]
    with use_abstract_mesh(H200):
        hlo = (
            jax.jit(functools.partial(tree_mla_attention, scale=0.1))
            .trace(*[jax.ShapeDtypeStruct(s, d) for s, d in shapes])
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    assert hlo.count("@mosaic_gpu_v2(") == 0
