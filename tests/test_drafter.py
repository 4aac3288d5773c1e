"""DFlash drafter: parity with z-lab's dflash 0.1.0 DFlashDraftModel (fixtures from scripts/make_dflash_fixtures.py),
cached form == full form, the on-disk layout, DrafterConfig's parsing and errors, sharding."""

import json
import os
import shutil
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from k26jax.config import ConfigError, DrafterConfig, build_target_layer_ids
from k26jax.hf import drafter_tensor_shapes, read_drafter, write_drafter
from k26jax.model import drafter as D

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "dflash")
DRAFTER_DIR = os.path.join(FIXTURES, "drafter")


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(os.path.join(FIXTURES, "reference.npz")))


@pytest.fixture(scope="module")
def drafter():
    cfg, params = read_drafter(DRAFTER_DIR)
    return cfg, params


@pytest.fixture(scope="module")
def raw_config():
    with open(os.path.join(DRAFTER_DIR, "config.json")) as f:
        return json.load(f)


def as_dtype(params, dtype):
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), params)


# ---- parity with the reference -------------------------------------------------------------------------
def test_float32_parity_with_reference(drafter, ref):
    cfg, params = drafter
    p32 = as_dtype(params, jnp.float32)
    args = (ref["embed_VD"], ref["context_features"], ref["bonus_ids"])
    layer_hidden, final_hidden = D.draft_hidden_states(p32, cfg, *args)
    logits = D.draft_logits(p32, cfg, ref["embed_VD"], ref["lm_head_DV"], ref["context_features"], ref["bonus_ids"])
    assert logits.dtype == jnp.float32 and logits.shape == ref["logits"].shape
    for i in range(cfg.num_hidden_layers):
        assert rel_err(layer_hidden[i], ref["layer_hidden"][i]) <= 1e-4, f"layer {i}"
    assert rel_err(final_hidden, ref["final_hidden"]) <= 1e-4
    assert rel_err(logits, ref["logits"]) <= 1e-4


def test_bfloat16_close_to_reference(drafter, ref):
    cfg, params = drafter
    logits = D.draft_logits(
        as_dtype(params, jnp.bfloat16),
        cfg,
        jnp.asarray(ref["embed_VD"], jnp.bfloat16),
        jnp.asarray(ref["lm_head_DV"], jnp.bfloat16),
        ref["context_features"],
        ref["bonus_ids"],
    )
    assert logits.dtype == jnp.float32
    err = rel_err(logits, ref["logits"])
    assert err <= 3e-2, err
    top1 = np.argmax(np.asarray(logits), -1) == np.argmax(ref["logits"], -1)
    assert top1.mean() >= 0.75


def test_cached_form_matches_reference_per_row(drafter, ref):
    """Row 0 sees its 10 context rows, row 1 only its first 6: each equals the reference run on that context."""
    cfg, params = drafter
    p32 = as_dtype(params, jnp.float32)
    feats = ref["context_features"]
    B, T, _ = feats.shape
    k, v = D.context_kv(p32, cfg, feats, jnp.broadcast_to(jnp.arange(T), (B, T)))
    ctx_len = jnp.array([T, int(ref["short_ctx_len"])])
    logits = D.draft_block(p32, cfg, ref["embed_VD"], ref["lm_head_DV"], k, v, ctx_len, ref["bonus_ids"], ctx_len)
    assert rel_err(logits[0], ref["logits"][0]) <= 1e-4
    assert rel_err(logits[1], ref["logits_short_row1"][0]) <= 1e-4


@pytest.mark.parametrize("case", ["default", "yarn_k2", "yarn_no_mscale_all_dim", "yarn_attention_factor_no_truncate"])
def test_rope_tables_match_hf(raw_config, ref, case):
    fields = json.loads(str(ref[f"rope_{case}_config"]))
    raw = {k: v for k, v in raw_config.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    cfg = DrafterConfig.from_dict({**raw, **fields})
    cos, sin = D.rope_cos_sin(cfg, jnp.asarray(ref["rope_positions"]))
    np.testing.assert_allclose(cos, ref[f"rope_{case}_cos"], atol=1e-6)
    np.testing.assert_allclose(sin, ref[f"rope_{case}_sin"], atol=1e-6)


# ---- cached form == full form ---------------------------------------------------------------------------
def test_draft_block_equals_draft_logits_ragged_cache():
    """A cache filled in two context_kv chunks (as the engine commits), rows past ctx_len holding garbage."""
    cfg = DrafterConfig(
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        rope=DrafterConfig.from_dict(_minimal_raw()).rope,
        block_size=5,
        target_layer_ids=(0, 2, 3),
        num_target_layers=5,
        mask_token_id=60,
        vocab_size=64,
        output_multiplier=1.3,
        final_logit_softcapping=8.0,
    )
    params = D.init_params(cfg, seed=1, dtype=jnp.float32)
    keys = jax.random.split(jax.random.key(0), 6)
    V, S = 64, 16
    embed = jax.random.normal(keys[0], (V, cfg.hidden_size))
    lm_head = jax.random.normal(keys[1], (cfg.hidden_size, V)) * 0.3
    ctx_len = np.array([11, 1, 7])
    B = len(ctx_len)
    feats = jax.random.normal(keys[2], (B, S, cfg.context_dim))
    bonus = jnp.array([3, 17, 59])
    positions = jnp.broadcast_to(jnp.arange(S), (B, S))
    split = 5
    k1, v1 = D.context_kv(params, cfg, feats[:, :split], positions[:, :split])
    k2, v2 = D.context_kv(params, cfg, feats[:, split:], positions[:, split:])
    garbage = 1e3 * jax.random.normal(keys[3], (cfg.num_hidden_layers, B, 2, S, 16))
    valid = (jnp.arange(S)[None, :] < ctx_len[:, None])[None, :, None, :, None]
    ctx_k = jnp.where(valid, jnp.concatenate([k1, k2], 3), garbage)
    ctx_v = jnp.where(valid, jnp.concatenate([v1, v2], 3), -garbage)
    got = D.draft_block(params, cfg, embed, lm_head, ctx_k, ctx_v, jnp.asarray(ctx_len), bonus, jnp.asarray(ctx_len))
    assert got.shape == (B, cfg.block_size - 1, V)
    for r in range(B):
        want = D.draft_logits(params, cfg, embed, lm_head, feats[r : r + 1, : ctx_len[r]], bonus[r : r + 1])
        assert rel_err(got[r], want[0]) <= 1e-5, r


def test_nnx_module_and_abstract_params(drafter, ref):
    cfg, _ = drafter
    module = D.DFlashDrafter(cfg, dtype=jnp.float32, rngs=D.nnx.Rngs(3))
    want = D.draft_logits(
        module.params(), cfg, ref["embed_VD"], ref["lm_head_DV"], ref["context_features"], ref["bonus_ids"]
    )
    np.testing.assert_array_equal(
        module(ref["embed_VD"], ref["lm_head_DV"], ref["context_features"], ref["bonus_ids"]), want
    )
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), D.abstract_params(cfg, jnp.bfloat16))
    _, disk = drafter
    assert shapes == jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), disk)


def test_module_methods_run_the_functions(drafter, ref):
    """DFlashDrafter.from_params holds a loaded tree; its context_kv / draft_block are the functions on it."""
    cfg, params = drafter
    p32 = as_dtype(params, jnp.float32)
    module = D.DFlashDrafter.from_params(cfg, p32)
    jax.tree.map(np.testing.assert_array_equal, module.params(), p32)
    feats = ref["context_features"]
    B, T, _ = feats.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    k, v = module.context_kv(feats, positions)
    want_k, want_v = D.context_kv(p32, cfg, feats, positions)
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)
    ctx_len = jnp.array([T, 5])
    args = (ref["embed_VD"], ref["lm_head_DV"], k, v, ctx_len, ref["bonus_ids"], ctx_len)
    np.testing.assert_array_equal(module.draft_block(*args), D.draft_block(p32, cfg, *args))


def test_bad_inputs_name_the_argument(drafter, ref):
    cfg, params = drafter
    with pytest.raises(ValueError, match="context_features"):
        D.draft_logits(
            params, cfg, ref["embed_VD"], ref["lm_head_DV"], ref["context_features"][..., :-1], ref["bonus_ids"]
        )
    with pytest.raises(ValueError, match="lm_head_DV"):
        D.draft_logits(params, cfg, ref["embed_VD"], ref["lm_head_DV"].T, ref["context_features"], ref["bonus_ids"])
    with pytest.raises(ValueError, match="bonus_ids"):
        D.draft_logits(params, cfg, ref["embed_VD"], ref["lm_head_DV"], ref["context_features"], ref["bonus_ids"][:1])
    k = jnp.zeros((cfg.num_hidden_layers, 2, cfg.num_key_value_heads + 1, 8, cfg.head_dim))
    with pytest.raises(ValueError, match="ctx_k"):
        D.draft_block(
            params,
            cfg,
            ref["embed_VD"],
            ref["lm_head_DV"],
            k,
            k,
            jnp.zeros(2, int),
            ref["bonus_ids"],
            jnp.zeros(2, int),
        )


# ---- on-disk layout -------------------------------------------------------------------------------------
def test_layout_round_trip_is_byte_exact(drafter, tmp_path):
    cfg, params = drafter
    write_drafter(tmp_path, cfg, params)
    cfg2, params2 = read_drafter(tmp_path)
    assert cfg2 == cfg
    with (
        safe_open(os.path.join(DRAFTER_DIR, "model.safetensors"), "np") as a,
        safe_open(os.path.join(tmp_path, "model.safetensors"), "np") as b,
    ):
        assert sorted(a.keys()) == sorted(b.keys()) == sorted(drafter_tensor_shapes(cfg))
        for name in a.keys():
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x.view(np.uint16), y.view(np.uint16))
    write_drafter(tmp_path / "f32", cfg, params, dtype="float32")
    assert jax.tree.all(
        jax.tree.map(
            lambda a, b: a.dtype == np.float32 and np.array_equal(a, np.float32(b)),
            read_drafter(tmp_path / "f32")[1],
            params,
        )
    )


def _rewrite(src_dir, dst, edit):
    shutil.copytree(src_dir, dst)
    path = os.path.join(dst, "model.safetensors")
    with safe_open(path, "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, path)
    return dst


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda t: t.pop("layers.1.self_attn.k_norm.weight"), r"missing tensors \['layers.1.self_attn.k_norm.weight'"),
        (
            lambda t: t.update({"layers.0.mlp.up_proj.weight": t["layers.0.mlp.up_proj.weight"][:-1]}),
            r"model.safetensors: tensor 'layers.0.mlp.up_proj.weight' has shape \(383, 128\)",
        ),
        (
            lambda t: t.update({"candidate_selector.hidden_projection.weight": t["norm.weight"]}),
            "candidate_selector.hidden_projection.weight",
        ),
    ],
)
def test_layout_bad_files(tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        read_drafter(_rewrite(DRAFTER_DIR, tmp_path / "d", edit))


def test_layout_reads_sharded_checkpoints(drafter, tmp_path):
    """A drafter split over two files listed in model.safetensors.index.json reads as the single-file one."""
    cfg, params = drafter
    with safe_open(os.path.join(DRAFTER_DIR, "model.safetensors"), "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    names = sorted(tensors)
    weight_map = {n: f"model-0000{1 + (i % 2)}-of-00002.safetensors" for i, n in enumerate(names)}
    for file in set(weight_map.values()):
        save_file({n: tensors[n] for n in names if weight_map[n] == file}, os.path.join(tmp_path, file))
    shutil.copy(os.path.join(DRAFTER_DIR, "config.json"), tmp_path)
    with open(os.path.join(tmp_path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    _, sharded = read_drafter(tmp_path)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), sharded, params))
    os.remove(os.path.join(tmp_path, "model-00002-of-00002.safetensors"))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        read_drafter(tmp_path)


def test_save_rejects_bad_tree(drafter, tmp_path):
    cfg, params = drafter
    bad = jax.tree.map(lambda a: a, params)
    bad["layers"]["attn"]["o"] = bad["layers"]["attn"]["o"][:, :-1]
    with pytest.raises(ValueError, match="layers/attn/o"):
        write_drafter(tmp_path, cfg, bad)


# ---- DrafterConfig --------------------------------------------------------------------------------------
def _minimal_raw(**changes):
    raw = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        num_target_layers=8,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0),
        dflash_config=dict(mask_token_id=62, target_layer_ids=[1, 5]),
    )
    raw.update(changes)
    return raw


def test_config_from_fixture_and_legacy_rope_agree(raw_config):
    cfg = DrafterConfig.from_hf_dir(DRAFTER_DIR)
    assert (cfg.target_layer_ids, cfg.mask_token_id, cfg.block_size) == ((1, 2), 1022, 8)
    assert (cfg.output_multiplier, cfg.final_logit_softcapping, cfg.input_embedding_scale) == (0.8, 6.0, 1.5)
    legacy = {k: v for k, v in raw_config.items() if k != "rope_parameters"}
    legacy.update(
        rope_theta=50000.0,
        rope_scaling=dict(
            type="yarn",
            factor=64.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    )
    assert DrafterConfig.from_dict(legacy) == cfg
    assert DrafterConfig.from_dict(cfg.to_hf_dict()) == cfg


def test_config_derives_target_layer_ids_and_defaults():
    assert build_target_layer_ids(61, 6) == [1, 12, 24, 35, 47, 58]
    assert build_target_layer_ids(36, 1) == [18]
    raw = _minimal_raw(
        num_target_layers=61, num_hidden_layers=6, dflash_config=dict(mask_token_id=1), rope_scaling=None
    )
    del raw["num_key_value_heads"]
    cfg = DrafterConfig.from_dict(raw)
    assert cfg.target_layer_ids == (1, 12, 24, 35, 47, 58)
    assert (cfg.num_key_value_heads, cfg.block_size, cfg.rope.kind, cfg.final_logit_softcapping) == (
        4,
        16,
        "default",
        None,
    )
    assert DrafterConfig.from_dict(_minimal_raw(final_logit_softcapping=0.0)).final_logit_softcapping is None
    assert (
        DrafterConfig.from_dict(
            _minimal_raw(block_size=8, dflash_config=dict(mask_token_id=3, target_layer_ids=[2], block_size=4))
        ).block_size
        == 4
    )  # dflash_config wins, as in dflash


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(architectures=["DFlash2DraftModel"]), "architectures"),
        (dict(conv_kernel_size=4), "conv_kernel_size"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(is_causal=True), "is_causal"),
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
        (dict(rope_scaling=dict(type="llama3", factor=8.0)), "rope_scaling"),
        (dict(rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1e4))), "rope_parameters"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(rope_theta=None, rope_scaling=None), "rope_theta"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(head_dim=None), "head_dim"),
        (dict(hidden_size=64.5), "hidden_size"),
        (dict(dflash_config=dict(target_layer_ids=[1])), "mask_token_id"),
        (dict(dflash_config=dict(mask_token_id=1, target_layer_ids="1,2")), "target_layer_ids"),
        (dict(dflash_config=dict(mask_token_id=1, block_size=1)), "block_size"),
        (dict(vocab_size=32), "mask_token_id"),
    ],
)
def test_config_refuses_what_it_cannot_honour(changes, match):
    raw = {k: v for k, v in _minimal_raw(**changes).items() if v is not None or k == "rope_theta"}
    with pytest.raises(ConfigError, match=match):
        DrafterConfig.from_dict(raw)


def test_check_target_names_the_field():
    cfg = DrafterConfig.from_dict(_minimal_raw(vocab_size=64))
    fits = SimpleNamespace(hidden_size=64, vocab_size=64, num_hidden_layers=6)
    cfg.check_target(fits)
    for changes, field in (
        (dict(hidden_size=128), "hidden_size"),
        (dict(vocab_size=128), "vocab_size"),
        (dict(num_hidden_layers=5), "target_layer_ids"),
    ):
        with pytest.raises(ConfigError, match=field):
            cfg.check_target(SimpleNamespace(**{**vars(fits), **changes}))
    with pytest.raises(ConfigError, match="mask_token_id"):
        cfg.replace(vocab_size=None).check_target(SimpleNamespace(**{**vars(fits), "vocab_size": 32}))


# ---- sharding -------------------------------------------------------------------------------------------
def test_partition_specs_follow_divisibility(drafter):
    cfg, params = drafter
    specs = D.drafter_partition_specs(cfg, 8)
    assert jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, D.P)) == jax.tree.structure(params)
    assert specs["layers"]["attn"]["q"] == D.P(None, None, None, None)  # 2 kv heads do not split 8 ways
    assert specs["layers"]["mlp"]["gate_up"] == D.P(None, None, None, "model")
    assert D.drafter_partition_specs(cfg, 2)["layers"]["attn"]["o"] == D.P(None, "model", None, None)
    assert D.drafter_cache_partition_spec(cfg, 2) == D.P(None, "data", "model", None, None)
    with pytest.raises(ValueError, match="model_axis_size"):
        D.drafter_partition_specs(cfg, 0)


def test_sharded_draft_block_matches_single_device(drafter, ref):
    cfg, params = drafter
    p32 = as_dtype(params, jnp.float32)
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    feats = ref["context_features"]
    B, T, _ = feats.shape
    k, v = D.context_kv(p32, cfg, feats, jnp.broadcast_to(jnp.arange(T), (B, T)))
    ctx_len = jnp.array([T, 4])
    args = (ref["embed_VD"], ref["lm_head_DV"], k, v, ctx_len, ref["bonus_ids"], ctx_len)
    want = D.draft_block(p32, cfg, *args)
    specs = D.drafter_partition_specs(cfg, 2)
    sharded = jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), p32, specs, is_leaf=lambda x: isinstance(x, D.P)
    )
    cache = NamedSharding(mesh, D.drafter_cache_partition_spec(cfg, 2))
    got = D.draft_block(sharded, cfg, args[0], args[1], jax.device_put(k, cache), jax.device_put(v, cache), *args[4:])
    assert rel_err(got, want) <= 1e-5
