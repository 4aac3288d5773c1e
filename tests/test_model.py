"""Model blocks against numpy float64, prefill == decode, tree tails, and 8-device == 1-device."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import k26jax
from k26jax import cache as kc
from k26jax import ops, sharding
from k26jax.config import ConfigError, ModelConfig, preset, preset_text_config
from k26jax.model import layers as L
from k26jax.model import params as param_table
from k26jax.model import target
from pallas_kernels import few_row_gemm

IMPLS = ops.Impls()


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, target.init_params(cfg, seed=0, dtype=jnp.float32)


@functools.partial(jax.jit, static_argnums=(3,))
def prefill(params, ids, lengths, cfg):
    return target.forward_prefill(params, cfg, ids, lengths, IMPLS)


@functools.partial(jax.jit, static_argnums=(6,))
def tail(params, ids, positions, rows, lengths, vis, cfg):
    return target.forward_tail(params, cfg, ids, positions, rows, lengths, vis, IMPLS)


# ---- blocks vs numpy float64 -----------------------------------------------------------------------------
def test_rms_norm_matches_numpy():
    x = np.random.default_rng(0).normal(size=(3, 5, 48))
    w = np.random.default_rng(1).normal(size=48)
    ref = w * x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    assert rel_err(L.rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), 1e-6), ref) < 1e-6


@pytest.mark.parametrize(
    "name,anchors",
    [
        (
            "k26",
            {
                0: 1.0,
                8: 6.687403e-02,
                9: 4.377666e-02,
                14: 4.465849e-03,
                19: 1.583750e-04,
                20: 1.807023e-05,
                31: 4.382206e-07,
            },
        ),
        (
            "k2",
            {
                0: 1.0,
                8: 6.687403e-02,
                9: 4.768861e-02,
                14: 8.794287e-03,
                19: 1.621760e-03,
                20: 3.614047e-05,
                31: 8.764413e-07,
            },
        ),
    ],
)
def test_yarn_inv_freq_anchors(name, anchors):
    text = preset_text_config("k26")
    if name == "k2":
        text["rope_scaling"] = dict(text["rope_scaling"], factor=32.0, beta_fast=1.0)
    inv_freq, attention_factor = L.rope_inv_freq(ModelConfig.from_hf_dict(text))
    assert attention_factor == 1.0
    for i, v in anchors.items():
        assert inv_freq[i] == pytest.approx(v, rel=2e-6), i


def test_softmax_scale_k26():
    assert preset("k26").softmax_scale == pytest.approx(0.1446796, rel=1e-6)


def test_rope_is_complex_rotation_of_interleaved_pairs():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 7, 3, 16))
    pos = rng.integers(0, 5000, size=(2, 7))
    inv_freq = 1.0 / 50000.0 ** (np.arange(0, 16, 2) / 16)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * pos[..., None, None] * inv_freq)
    ref = np.concatenate([z.real, z.imag], -1)  # half layout
    got = L.apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(pos), inv_freq.astype(np.float32), 1.0)
    assert rel_err(got, ref) < 2e-5


def numpy_naive_mla(attn, x, cfg, rope):
    """Expanded MLA in float64 with the same weights (independent of the jnp code)."""
    a = {k: np.asarray(v, np.float64) for k, v in attn.items()}
    inv_freq, af = rope
    T = x.shape[1]
    pos = np.arange(T)

    def norm(v, w):
        return w * v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.latent_norm_eps)

    def rot(v):  # interleaved pairs -> half layout
        z = (v[..., 0::2] + 1j * v[..., 1::2]) * np.exp(1j * pos[:, None, None] * inv_freq) * af
        return np.concatenate([z.real, z.imag], -1)

    q = np.einsum("btr,rhq->bthq", norm(x @ a["q_a"], a["q_a_norm"]), a["q_b"])
    kv = x @ a["kv_a"]
    c = norm(kv[..., : cfg.kv_lora_rank], a["kv_a_norm"])
    k_pe = rot(kv[..., None, cfg.kv_lora_rank :]).repeat(cfg.num_attention_heads, 2)
    k = np.concatenate([np.einsum("bsr,hnr->bshn", c, a["w_uk"]), k_pe], -1)
    qq = np.concatenate([q[..., : cfg.qk_nope_head_dim], rot(q[..., cfg.qk_nope_head_dim :])], -1)
    s = np.einsum("bthd,bshd->bhts", qq, k) * cfg.softmax_scale + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshv->bthv", p, np.einsum("bsr,hvr->bshv", c, a["w_uv"]))
    return np.einsum("bthv,hvd->btd", o, a["o"])


def test_mla_naive_and_absorbed_match_numpy(tiny):
    cfg, params = tiny
    attn = jax.tree.map(lambda a: a[0], params["moe"]["attn"])
    x = np.random.default_rng(3).normal(size=(2, 6, cfg.hidden_size)).astype(np.float32)
    rope = L.rope_inv_freq(cfg)
    ref = numpy_naive_mla(attn, x, cfg, rope)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    naive, rows = L.mla_naive(attn, jnp.asarray(x), pos, jnp.ones((2, 6), bool), cfg, rope)
    assert rel_err(naive, ref) < 1e-5
    q_lat, q_pe = L.mla_absorbed_queries(attn, jnp.asarray(x), pos, cfg, rope)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((6, 6), bool)), (2, 6, 6))
    o_lat = ops.mla_attention(
        q_lat,
        q_pe,
        jnp.zeros((1, 2, 4, cfg.latent_dim)),
        jnp.zeros(2, jnp.int32),
        rows,
        causal,
        scale=cfg.softmax_scale,
        layer=0,
        impls=IMPLS,
    )
    assert rel_err(L.mla_absorbed_output(attn, o_lat), ref) < 1e-5


def numpy_route(kernel, bias, x, cfg):
    s = 1 / (1 + np.exp(-(x.astype(np.float64) @ kernel.astype(np.float64))))
    b = s + bias
    if cfg.n_group > 1:
        g = b.reshape(len(b), cfg.n_group, -1)
        gs = np.sort(g, -1)[..., -2:].sum(-1)
        keep = np.argsort(-gs, -1, kind="stable")[:, : cfg.topk_group]
        mask = np.zeros_like(gs, bool)
        np.put_along_axis(mask, keep, True, -1)
        b = np.where(mask.repeat(g.shape[-1], 1), b, -np.inf)
    ids = np.argsort(-b, -1, kind="stable")[:, : cfg.num_experts_per_tok]
    w = np.take_along_axis(s, ids, -1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return ids, w * cfg.routed_scaling_factor


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (4, 1, False)])
def test_router_matches_numpy_and_bias_changes_selection(n_group, topk_group, norm):
    cfg = preset("tiny").replace(n_group=n_group, topk_group=topk_group, norm_topk_prob=norm)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(64, cfg.hidden_size)).astype(np.float32)
    kernel = (rng.normal(size=(cfg.hidden_size, cfg.n_routed_experts)) * 0.05).astype(np.float32)
    bias = (rng.normal(size=cfg.n_routed_experts) * 0.3).astype(np.float32)
    ids, w = L.route(jnp.asarray(kernel), jnp.asarray(bias), jnp.asarray(x), cfg)
    ref_ids, ref_w = numpy_route(kernel, bias, x, cfg)
    np.testing.assert_array_equal(np.sort(ids, -1), np.sort(ref_ids, -1))
    np.testing.assert_allclose(np.sort(w, -1), np.sort(ref_w, -1), rtol=1e-5)
    unbiased, _ = L.route(jnp.asarray(kernel), jnp.zeros_like(jnp.asarray(bias)), jnp.asarray(x), cfg)
    assert (np.sort(unbiased, -1) != np.sort(ids, -1)).any(), "the bias must change some selections"


def test_dense_dots_pad_rows_on_the_gpu(monkeypatch):
    """On the GPU, dots of fewer than GPU_MIN_ROWS rows run padded (so cuBLAS reads stacked weights in place) and
    are cut back: same shapes and values as unpadded. Checked on the CPU by posing as the GPU."""
    cfg = preset("tiny")
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.normal(size=(cfg.hidden_size, 24)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(cfg.hidden_size, cfg.n_routed_experts)) * 0.05, jnp.float32)
    bias = jnp.zeros(cfg.n_routed_experts, jnp.float32)
    xs = [
        jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((1, 1, cfg.hidden_size), (2, 3, cfg.hidden_size))
    ]
    want = [(L.mm("btd,dk->btk", x, w), L.route(kernel, bias, x.reshape(-1, cfg.hidden_size), cfg)) for x in xs]
    assert L.pad_rows(xs[0]) is xs[0]  # the CPU never pads
    monkeypatch.setattr(L.jax, "default_backend", lambda: "gpu")
    assert L.pad_rows(xs[0], 1).shape[0] == L.GPU_MIN_ROWS
    assert L.pad_rows(xs[1], 3).shape[0] == 3  # 3 x 3 rows >= 8
    assert L.pad_rows(xs[1], 4) is xs[1]
    for x, (dot, (ids, weights)) in zip(xs, want):
        np.testing.assert_allclose(L.mm("btd,dk->btk", x, w), dot, rtol=1e-5, atol=1e-5)
        got_ids, got_weights = L.route(kernel, bias, x.reshape(-1, cfg.hidden_size), cfg)
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_allclose(got_weights, weights, rtol=1e-6)


@pytest.mark.parametrize(
    "subscripts, x_shape, w_shape, kernel",
    [
        ("btd,dhq->bthq", (1, 1, 40), (40, 3, 5), True),
        ("bthv,hvd->btd", (2, 1, 3, 4), (3, 4, 33), True),
        ("bnd,de->bne", (1, 3, 8), (8, 1), True),
        ("btd,dk->btk", (1, 1, 1), (1, 7), True),
        ("bthr,hvr->bthv", (1, 2, 3, 16), (3, 5, 16), False),  # h is a batch axis: not a plain dot
    ],
)
def test_layer_weight_dots_equal_the_einsum(monkeypatch, subscripts, x_shape, w_shape, kernel):
    """mm of a layer of a stack (ops.LayerWeight), on fresh float32 inputs against numpy's einsum: through the
    few-row kernel (interpret mode) where its rows and pattern allow, else the slice; odd sizes, a contraction of
    1, and a head-batched dot that must not take the kernel."""
    rng = np.random.default_rng(sum(x_shape) + sum(w_shape))
    x, stack = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal((3, *w_shape)).astype(np.float32)
    want = np.einsum(subscripts, x.astype(np.float64), stack[2].astype(np.float64))
    calls, real = [], few_row_gemm.few_row_gemm
    monkeypatch.setattr(few_row_gemm, "few_row_gemm", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    rows = x_shape[0] * x_shape[1]
    for dense_rows in (rows, rows - 1):
        calls.clear()
        w = ops.LayerWeight(jnp.asarray(stack), jnp.int32(2), ops.Impls(dense_rows=dense_rows, interpret=True))
        got = L.mm(subscripts, jnp.asarray(x), w, out_dtype=jnp.float32)
        assert got.shape == want.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert len(calls) == (kernel and dense_rows >= rows)


# ---- whole model -------------------------------------------------------------------------------------------
def test_prefill_equals_token_by_token_decode(tiny):
    cfg, params = tiny
    B, T, P = 2, 10, 3
    ids = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
    full, rows, _ = prefill(params, ids, jnp.array([T, T]), cfg)
    cache = kc.init_cache(cfg, B, 16, jnp.float32)
    _, rows_p, _ = prefill(params, ids[:, :P], jnp.array([P, P]), cfg)
    cache = kc.write_prefill(cache, rows_p, jnp.array([P, P]))
    vis = jnp.ones((B, 1, 1), bool)
    for t in range(P, T):
        logits, tail_rows, _ = tail(params, ids[:, t : t + 1], jnp.full((B, 1), t), cache.rows, cache.lengths, vis, cfg)
        assert rel_err(logits[:, 0], full[:, t]) < 1e-5, t
        cache = kc.commit_tail(cache, tail_rows, jnp.zeros((B, 1), jnp.int32), jnp.ones(B, jnp.int32))
    np.testing.assert_allclose(cache.rows[:, :, :T], rows, atol=1e-5)


def test_tree_tail_rows_see_exactly_their_ancestors(tiny):
    """Node logits of a verified tree equal the prefill logits of the path to that node."""
    cfg, params = tiny
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, cfg.vocab_size, size=(1, 5))
    parents = np.array([-1, 0, 0, 1, 2, 1, 4])  # node 0 = root (last prompt token)
    tokens = rng.integers(0, cfg.vocab_size, size=len(parents))
    depth = np.zeros(len(parents), int)
    vis = np.eye(len(parents), dtype=bool)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
        vis[i] |= vis[parents[i]]
    _, rows, _ = prefill(params, prompt[:, :4], jnp.array([4]), cfg)
    cache = kc.write_prefill(kc.init_cache(cfg, 1, 8, jnp.float32), rows, jnp.array([4]))
    tokens[0] = prompt[0, 4]
    logits, _, _ = tail(params, tokens[None], (4 + depth)[None], cache.rows, cache.lengths, vis[None], cfg)
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        seq = np.concatenate([prompt[0, :4], path[::-1]])[None]
        ref, _, _ = prefill(params, seq, jnp.array([seq.shape[1]]), cfg)
        assert rel_err(logits[0, i], ref[0, -1]) < 1e-5, i


@pytest.mark.parametrize("expert_mode", ["ep", "tp"])
def test_eight_devices_equal_one_device(tiny, expert_mode):
    cfg, params = tiny
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, size=(2, 7))
    one = k26jax.Model(cfg, jax.tree.map(jnp.asarray, params), IMPLS).logits(ids)
    mesh = sharding.make_mesh(8)
    placed = k26jax.api.place(params, cfg, mesh, expert_mode)
    assert (
        placed["moe"]["mlp"]["w13_packed"].sharding.spec
        == sharding.param_partition_specs(cfg, expert_mode)["moe"]["mlp"]["w13_packed"]
    )
    eight = k26jax.Model(cfg, placed, IMPLS, mesh).logits(ids)
    assert rel_err(eight, one) < 1e-5


# ---- bad input ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda c: c.update(model_type="llama"), "unknown model_type 'llama'"),
        (lambda c: c.update(scoring_func="softmax"), "scoring_func"),
        (lambda c: c.update(topk_method="greedy"), "topk_method"),
        (lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling type 'linear'"),
        (lambda c: c.update(kv_lora_rank=None), "kv_lora_rank: expected an integer, got None"),
        (lambda c: c.update(n_group=3), "n_group"),
    ],
)
def test_config_errors_name_the_field(mutate, match):
    text = preset_text_config("tiny")
    mutate(text)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf_dict(text)


def test_wrapper_configs(tmp_path):
    text = preset_text_config("tiny")
    with pytest.raises(ConfigError, match="no 'text_config'"):
        ModelConfig.from_hf_dict({"model_type": "kimi_k25"})
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with pytest.raises(ConfigError, match="FP8"):
        ModelConfig.from_hf_dict(dict(text, quantization_config=fp8))
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "kimi_k25", "text_config": text, "quantization_config": None})
    )
    cfg = ModelConfig.from_hf_dir(tmp_path)
    assert cfg.hidden_size == text["hidden_size"] and cfg.quant is None
    rp = dict(text, rope_parameters=dict(text.pop("rope_scaling"), rope_theta=text.pop("rope_theta")))
    assert ModelConfig.from_hf_dict(rp).rope_scaling == preset("tiny").rope_scaling
    q_null = ModelConfig.from_hf_dict(dict(preset_text_config("tiny"), q_lora_rank=None))
    assert "q" in target.abstract_params(q_null)["dense"]["attn"]


def test_token_ids_out_of_range_are_refused(tiny):
    cfg, params = tiny
    model = k26jax.Model(cfg, params, IMPLS)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.logits(np.array([[1, cfg.vocab_size]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.logits(np.array([[-1, 2]]))


def test_only_multi_layer_segments_scan(tiny):
    """A one-layer segment (K2.6's single dense layer) runs unscanned: a scan of one would copy the layer's
    weights out of their stack with a dynamic slice every step."""
    cfg, params = tiny
    assert [count for _, _, count, _ in target.segments(cfg)] == [1, 3]
    ids = jnp.zeros((1, 4), jnp.int32)
    hlo = prefill.trace(params, ids, jnp.array([4]), cfg).lower().as_text()
    assert hlo.count("stablehlo.while") == 2  # the 3-layer MoE segment and the reference MoE's expert scan


# ---- the NNX module and the parameter table ---------------------------------------------------------------
def test_module_methods_run_the_forward(tiny):
    """K2Model's prefill and decode (= verify of one token) equal the functions, the module split at the jit
    boundary and merged inside (shapes as in the prefill == decode test, so those compiles are shared)."""
    cfg, params = tiny
    model = target.K2Model.from_params(cfg, params)
    jax.tree.map(np.testing.assert_array_equal, model.params(), params)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids, lengths, tail_ids, positions, rows, prefix_len):
        m = nnx.merge(graphdef, state)
        return m.prefill(ids, lengths, IMPLS), m.decode(tail_ids, positions, rows, prefix_len, IMPLS)

    ids = jax.random.randint(jax.random.key(2), (2, 10), 0, cfg.vocab_size)
    lengths = jnp.array([10, 7])
    want_prefill = prefill(params, ids, lengths, cfg)
    cache = kc.write_prefill(kc.init_cache(cfg, 2, 16, jnp.float32), want_prefill[1], lengths)
    positions = lengths[:, None]
    want_decode = tail(params, ids[:, :1], positions, cache.rows, cache.lengths, jnp.ones((2, 1, 1), bool), cfg)
    got_prefill, got_decode = step(state, ids, lengths, ids[:, :1], positions, cache.rows, cache.lengths)
    for got, want in ((got_prefill, want_prefill), (got_decode, want_decode)):
        assert rel_err(got[0], want[0]) < 1e-6 and rel_err(got[1], want[1]) < 1e-6


def test_table_derives_params_specs_and_shapes():
    """One declaration: abstract params, init, partition specs and numpy shapes share the table's tree."""
    for cfg in (preset("tiny"), preset("k26-depth3"), preset("tiny").replace(n_shared_experts=0)):
        table = param_table.target_table(cfg)
        abstract = target.abstract_params(cfg)
        is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
        for mode in ("ep", "tp"):
            specs = sharding.param_partition_specs(cfg, mode)
            assert jax.tree.structure(specs, is_leaf=is_spec) == jax.tree.structure(abstract)
            jax.tree.map(
                lambda s, a: len(s) == a.ndim or pytest.fail(f"{s} {a.shape}"), specs, abstract, is_leaf=is_spec
            )
            experts = {k: v for k, v in specs["moe"]["mlp"].items() if k in target.EXPERT_KEYS}
            assert experts == sharding.expert_partition_specs(mode)
        shapes = param_table.shapes(table, "float32")
        got = jax.tree.map(lambda a: (a.shape, a.dtype), target.abstract_params(cfg, jnp.float32))
        assert got == jax.tree.map(lambda s: s, shapes, is_leaf=lambda x: isinstance(x, tuple))
    assert sharding.expert_partition_specs("tp")["w13_packed"] == jax.sharding.PartitionSpec(None, *[None] * 3, "model")
    with pytest.raises(ValueError, match="expert_mode"):
        sharding.expert_partition_specs("dp")
