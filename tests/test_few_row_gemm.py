"""few_row_gemm: the Pallas kernel (interpret mode) and the reference against float64 numpy on fresh inputs at edge
sizes (1-64 rows, K and N off the block sizes, a traced layer of a stack), its plan, its cuda lowering (the layer
read in place), and its argument errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as plgpu
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from pallas_kernels.few_row_gemm import BLOCK_K, MAX_ROWS, TARGET_PROGRAMS, few_row_gemm, few_row_gemm_reference, plan

H200 = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
)


def inputs(seed, M, K, N, layers, dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = (rng.standard_normal((layers, K, N) if layers else (K, N)) / np.sqrt(K)).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


@pytest.mark.parametrize(
    "M, K, N, layers, dtype",
    [
        (1, 256, 576, None, jnp.float32),  # N a multiple of 64, not 128
        (3, 200, 100, 3, jnp.float32),  # K and N off the blocks, a stack
        (8, 512, 1536, 2, jnp.bfloat16),
        (16, 64, 8, None, jnp.float32),  # N under one block
        (33, 130, 70, 4, jnp.bfloat16),  # a DDTree-32 verify's rows
        (MAX_ROWS, BLOCK_K, 128, 1, jnp.float32),
    ],
)
def test_kernel_and_reference_equal_float64(M, K, N, layers, dtype):
    x, w = inputs(M * K + N, M, K, N, layers, dtype)
    layer = None if layers is None else jnp.int32(layers - 1)  # traced under the jit below
    want = np.asarray(x, np.float64) @ np.asarray(w if layers is None else w[layers - 1], np.float64)
    got = jax.jit(lambda x, w, l: few_row_gemm(x, w, layer=l, out_dtype=jnp.float32, interpret=True))(x, w, layer)
    ref = few_row_gemm_reference(x, w, layer=layer, out_dtype=jnp.float32)
    assert got.shape == ref.shape == (M, N) and got.dtype == jnp.float32
    # fp32 sums in different orders; the inputs are exact in fp32 either way
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ref, want, rtol=1e-5, atol=1e-5)
    assert few_row_gemm(x, w, layer=layer, interpret=True).dtype == dtype  # x's dtype by default


def test_weight_cast_to_x_dtype_first():
    """mm's contract: a float32 weight meets bf16 activations as bf16 (kernel and reference alike)."""
    x, w = inputs(1, 2, 96, 64, None, jnp.float32)
    xb = x.astype(jnp.bfloat16)
    want = np.asarray(xb, np.float64) @ np.asarray(w.astype(jnp.bfloat16), np.float64)
    for f in (few_row_gemm_reference, lambda *a, **k: few_row_gemm(*a, interpret=True, **k)):
        np.testing.assert_allclose(f(xb, w, out_dtype=jnp.float32), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K, N", [(7168, 576), (7168, 1536), (1536, 1536), (1024, 7168), (256, 7168), (7168, 512)])
def test_plan_fills_the_gpu(K, N):
    """The dense shapes of one TP-8 K2.6 layer (kv_a, q_a, q_b, o, the shared expert) get about TARGET_PROGRAMS
    programs, or as many as K blocks allow, and every split has work."""
    rows, block_n, splits, steps = plan(1, K, N)
    programs = -(-N // block_n) * splits
    assert rows == 16 and N % block_n == 0
    assert (splits - 1) * steps < -(-K // BLOCK_K) <= splits * steps
    assert programs >= min(TARGET_PROGRAMS // 2, -(-N // block_n) * (K // BLOCK_K)), programs


def test_cuda_lowering_reads_the_layer_in_place():
    x, w, layer = jnp.ones((1, 7168), jnp.bfloat16), jnp.ones((4, 7168, 576), jnp.bfloat16), jnp.int32(2)
    with use_abstract_mesh(H200):
        hlo = (
            jax.jit(lambda x, w, l: few_row_gemm(x, w, layer=l))
            .trace(x, w, layer)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
    assert hlo.count(plgpu.CUSTOM_CALL_TARGET_NAME) == 1
    assert "dynamic_slice" not in hlo and "tensor<28672x576xbf16>" in hlo  # the [L*K, N] view


@pytest.mark.parametrize(
    "x_shape, w_shape, layer, match",
    [
        ((MAX_ROWS + 1, 8), (8, 4), None, "M <= 64"),
        ((2, 8), (9, 4), None, "K = 8"),
        ((2, 8), (3, 8, 4), None, r"\[K, N\]"),
        ((2, 8), (8, 4), 0, r"stack \[L, K, N\]"),
        ((2, 8), (3, 8, 4), 1.0, "integer scalar"),
    ],
)
def test_bad_arguments_name_what_is_wrong(x_shape, w_shape, layer, match):
    x, w = jnp.zeros(x_shape), jnp.zeros(w_shape)
    for f in (few_row_gemm, few_row_gemm_reference):
        with pytest.raises(ValueError, match=match):
            f(x, w, layer=layer)


def test_a_stack_beyond_int32_offsets_is_refused_and_ops_falls_back(monkeypatch):
    """Triton's int32 offsets: a stack of 2^31 elements or more would read the wrong rows, so the kernel refuses
    it by name and ops.dense_gemm leaves it to XLA's dot (checked with the limit lowered)."""
    import pallas_kernels.few_row_gemm as module
    from k26jax import ops

    monkeypatch.setattr(module, "MAX_ELEMENTS", 3 * 8 * 4)
    x, w = jnp.ones((1, 8)), jnp.ones((3, 8, 4))
    with pytest.raises(ValueError, match="int32 offsets"):
        few_row_gemm(x, w, layer=0, interpret=True)
    impls = ops.Impls(dense_rows=8, interpret=True)
    assert ops.dense_gemm(x, ops.LayerWeight(w, 0, impls), jnp.float32) is None
    assert ops.dense_gemm(x, ops.LayerWeight(w[:2], 0, impls), jnp.float32).shape == (1, 4)


def test_bench_dense_gemm_quick_run_records_every_variant(import_script, tmp_path):
    """scripts/bench_dense_gemm.py --quick (interpret mode): each row has cuBLAS, the kernel and each raced plan,
    its floor, and the kernel within bf16 rounding of the float64 product."""
    out = tmp_path / "dense.json"
    bench = import_script("bench_dense_gemm")
    assert (
        bench.main(
            [
                "--quick",
                "--rows",
                "1",
                "3",
                "--layers",
                "2",
                "--repeats",
                "1",
                "--programs",
                "8",
                "--unroll",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads(out.read_text())
    assert len(record["rows"]) == len(bench.QUICK) * 2 and record["ceilings"]["copy_TBps"] > 0
    for row in record["rows"]:
        assert {"cublas_us", "kernel_us", "kernel_p8_us", "floor_us"} <= set(row) and row["kernel_rel_err"] < 1e-2
        assert row["plans"]["8"][2] * -(-row["N"] // row["plans"]["8"][1]) <= 8 * 2  # ~8 programs
