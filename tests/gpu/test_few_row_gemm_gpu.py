"""few_row_gemm on the GPU: at the dense shapes of one TP-8 K2.6 layer (bf16, 1-64 rows, inside a layer scan over
stacked weights, as the model runs them) it equals the float64 product as closely as cuBLAS does; and with
Impls.dense_rows on, greedy DDTree and chain emit AR's tokens on the trained mini pair in float32 (lossless)."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import k26jax
from k26jax import ops
from k26jax.model import layers as L

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINI = os.path.join(ROOT, "checkpoints", "mini")
SHAPES = [  # (subscripts, x [B, T, ...] without B/T, w): q_a, q_b, kv_a, o, the router at TP-8 K2.6 widths
    ("btd,dr->btr", (7168,), (7168, 1536)),
    ("btr,rhq->bthq", (1536,), (1536, 8, 192)),
    ("btd,dc->btc", (7168,), (7168, 576)),
    ("bthv,hvd->btd", (8, 128), (8, 128, 7168)),
    ("btd,de->bte", (7168,), (7168, 384)),
]


def _scan(subscripts, x, w_stack, dense_rows):
    """Each layer's dot of x with its layer of the stack, the way the model's layer scan reads weights."""
    impls = ops.Impls(dense_rows=dense_rows)

    def body(_, xs):
        layer, w = xs
        return None, L.mm(subscripts, x, ops.LayerWeight(w_stack, layer, impls, w), out_dtype=jnp.float32)

    layers = jnp.arange(w_stack.shape[0], dtype=jnp.int32)
    f = jax.jit(lambda: jax.lax.scan(body, None, (layers, w_stack))[1], compiler_options=ops.COMPILER_OPTIONS)
    return np.asarray(f(), np.float64)


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("subscripts, x_tail, w_shape", SHAPES)
def test_few_row_gemm_equals_the_product_like_cublas(subscripts, x_tail, w_shape, rows):
    kx, kw = jax.random.split(jax.random.key(rows + len(w_shape)))
    x = jax.random.normal(kx, (rows, 1, *x_tail), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (3, *w_shape), jnp.float32) / np.sqrt(w_shape[0])).astype(jnp.bfloat16)
    want = np.stack([np.einsum(subscripts, np.asarray(x, np.float64), np.asarray(wi, np.float64)) for wi in w])
    scale = np.linalg.norm(want)
    err_kernel = np.linalg.norm(_scan(subscripts, x, w, 64) - want) / scale
    err_cublas = np.linalg.norm(_scan(subscripts, x, w, 0) - want) / scale
    assert err_kernel < 1e-5 and err_cublas < 1e-2, (err_kernel, err_cublas)


def test_greedy_ddtree_and_chain_equal_ar_with_the_few_row_gemm():
    model = k26jax.load(MINI, dtype="float32", impls=dataclasses.replace(ops.Impls.auto(), dense_rows=64))
    texts = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n    "]
    prompts = [model.tokenizer.encode(t) for t in texts]
    runs = {m: k26jax.generate(model, prompts, max_new_tokens=48, method=m) for m in ("ar", "chain", "ddtree")}
    assert runs["chain"].tokens == runs["ar"].tokens == runs["ddtree"].tokens
    assert runs["ddtree"].stats["tau"] > 1.5  # the trained pair accepts drafts: the tree path ran
