"""ModelConfig reads config.json as transformers does: an absent field takes DeepseekV3Config's default, and a
value k26jax cannot honour is refused naming the field. Fast, CPU only, no jax."""

import math

import pytest

from k26jax.config import QUANT_CONFIG, ConfigError, DrafterConfig, ModelConfig, preset_text_config

# transformers' DeepseekV3Config defaults, written out by hand from
# src/transformers/models/deepseek_v3/configuration_deepseek_v3.py (v4.57.1 and v5.24.0 agree), keyed by the
# ModelConfig attribute. moe_layer_freq / scoring_func / topk_method are DeepSeek-V3's configuration_deepseek.py
# defaults (transformers' model behaves that way without the fields).
DSV3_DEFAULTS = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    moe_layer_freq=1,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    bos_token_id=0,
    eos_token_ids=(1,),
    pad_token_id=None,
)

# The shape of deepseek-ai/DeepSeek-V3's and DeepSeek-R1's published config.json (the fields k26jax reads are the
# same in both): no pad_token_id, FP8 block weights.
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def as_form(text: dict, form: str) -> dict:
    """`text` as a plain deepseek_v3 config.json or inside the K2.5/K2.6 kimi_k25 wrapper."""
    if form == "deepseek_v3":
        return dict(text, model_type="deepseek_v3", quantization_config=QUANT_CONFIG)
    return {"model_type": "kimi_k25", "text_config": text, "quantization_config": QUANT_CONFIG}


FORMS = ["deepseek_v3", "kimi_k25"]

# config.json key -> (ModelConfig attribute, changes to the tiny preset that keep it valid without the key).
# Only keys that today's reader required or defaulted differently: the others are covered by the all-absent test.
ABSENT_CASES = {
    "vocab_size": ("vocab_size", {}),
    "hidden_size": ("hidden_size", {}),
    "intermediate_size": ("intermediate_size", {}),
    "moe_intermediate_size": ("moe_intermediate_size", {}),
    "num_hidden_layers": ("num_hidden_layers", {}),
    "num_attention_heads": ("num_attention_heads", {"num_key_value_heads": None}),  # both absent: 128 == 128
    "q_lora_rank": ("q_lora_rank", {}),
    "kv_lora_rank": ("kv_lora_rank", {}),
    "qk_nope_head_dim": ("qk_nope_head_dim", {}),
    "qk_rope_head_dim": ("qk_rope_head_dim", {}),
    "v_head_dim": ("v_head_dim", {}),
    "n_routed_experts": ("n_routed_experts", {}),
    "n_shared_experts": ("n_shared_experts", {}),
    "num_experts_per_tok": ("num_experts_per_tok", {}),
    "first_k_dense_replace": ("first_k_dense_replace", {}),
    "n_group": ("n_group", {"topk_group": 2}),  # 8 groups of 2 experts: 2 kept groups hold top-4
    "topk_group": ("topk_group", {"n_group": 4}),
    "norm_topk_prob": ("norm_topk_prob", {}),
    "routed_scaling_factor": ("routed_scaling_factor", {}),
    "rms_norm_eps": ("rms_norm_eps", {}),
    "rope_theta": ("rope_theta", {}),
    "max_position_embeddings": ("max_position_embeddings", {}),
    "bos_token_id": ("bos_token_id", {}),
    "eos_token_id": ("eos_token_ids", {}),
    "pad_token_id": ("pad_token_id", {}),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("key", sorted(ABSENT_CASES))
def test_absent_field_takes_transformers_default(key, form):
    attr, changes = ABSENT_CASES[key]
    text = {k: v for k, v in dict(preset_text_config("tiny"), **changes).items() if k != key and v is not None}
    cfg = ModelConfig.from_hf_dict(as_form(text, form))
    assert getattr(cfg, attr) == DSV3_DEFAULTS[attr]
    stated = 1 if key == "eos_token_id" else DSV3_DEFAULTS[attr]
    assert cfg == ModelConfig.from_hf_dict(as_form(dict(text, **{key: stated}), form))  # absent reads as stated


@pytest.mark.parametrize("raw", [{"model_type": "deepseek_v3"}, {"model_type": "kimi_k25", "text_config": {}}])
def test_a_config_of_defaults_only_is_transformers_default_config(raw):
    """Every field absent, the ones today's reader already defaulted included (moe_layer_freq, scoring_func,
    topk_method, tie_word_embeddings, hidden_act, attention_bias, num_key_value_heads, rope_scaling)."""
    cfg = ModelConfig.from_hf_dict(raw)
    assert {f: getattr(cfg, f) for f in DSV3_DEFAULTS} == DSV3_DEFAULTS
    assert cfg.quant is None and cfg.layer_kinds == ("dense",) * 3 + ("moe",) * 58


@pytest.mark.parametrize("form", FORMS)
def test_config_without_pad_and_bos_token_id_loads(form):
    text = {k: v for k, v in preset_text_config("k26").items() if k not in ("pad_token_id", "bos_token_id")}
    cfg = ModelConfig.from_hf_dict(as_form(text, form))
    assert (cfg.bos_token_id, cfg.pad_token_id, cfg.eos_token_ids) == (0, None, (163585,))
    assert cfg.hidden_size == 7168 and cfg.num_moe_layers == 60


def test_wrapper_token_ids_fill_in_for_the_text_config():
    text = {k: v for k, v in preset_text_config("tiny").items() if not k.endswith("_token_id")}
    raw = dict(as_form(text, "kimi_k25"), bos_token_id=768, eos_token_id=769, pad_token_id=1023)
    cfg = ModelConfig.from_hf_dict(raw)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (768, (769,), 1023)


def test_published_deepseek_v3_config():
    """It has no pad_token_id: loads unquantized; with its FP8 quantization_config it is refused for that."""
    with pytest.raises(ConfigError, match="quantization_config.*FP8"):
        ModelConfig.from_hf_dict(DEEPSEEK_V3_CONFIG)
    raw = {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "quantization_config"}
    cfg = ModelConfig.from_hf_dict(raw)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_ids) == (None, 0, (1,))
    assert (cfg.n_group, cfg.topk_group, cfg.num_moe_layers, cfg.quant) == (8, 4, 58, None)
    mscale = 0.1 * math.log(40) + 1
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * mscale * mscale, rel=1e-12)


def test_yarn_without_original_length_uses_max_position_embeddings():
    """transformers: original_max_position_embeddings falls back to max_position_embeddings, beta_fast/slow to
    32/1 when absent, the attention factor to factor's own when mscale/mscale_all_dim are absent."""
    text = preset_text_config("tiny")
    text["rope_scaling"] = {"type": "yarn", "factor": 8.0}
    rs = ModelConfig.from_hf_dict(dict(text, max_position_embeddings=32768)).rope_scaling
    assert (rs.factor, rs.original_max_position_embeddings, rs.beta_fast, rs.beta_slow) == (8.0, 32768, 32.0, 1.0)
    assert rs.mscale_all_dim == 0.0
    text["rope_parameters"] = dict(text.pop("rope_scaling"), rope_theta=1e6)
    cfg = ModelConfig.from_hf_dict({k: v for k, v in text.items() if k != "rope_theta"})
    assert (cfg.rope_theta, cfg.rope_scaling.original_max_position_embeddings) == (1e6, 4096)


def rope(**fields):
    return dict(preset_text_config("tiny")["rope_scaling"], **fields)


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(rope_interleave=False), "rope_interleave"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(num_key_value_heads=None, num_attention_heads=8), "num_key_value_heads: 128 .absent"),
        (dict(rope_scaling=rope(truncate=False)), r"rope_scaling\.truncate"),
        (dict(rope_scaling=rope(mscale=None)), r"rope_scaling\.mscale"),
        (dict(rope_scaling=rope(attention_factor=1.5)), r"rope_scaling\.attention_factor"),
        (dict(rope_scaling=rope(rope_theta=10000.0)), "rope_theta"),
        (dict(original_max_position_embeddings=8192), r"rope_scaling\.original_max_position_embeddings"),
    ],
)
def test_values_we_cannot_honour_are_refused(changes, field):
    text = {k: v for k, v in dict(preset_text_config("tiny"), **changes).items() if v is not None}
    if "rope_scaling" in changes:
        text["rope_scaling"] = {k: v for k, v in changes["rope_scaling"].items() if v is not None}
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict(text)


def test_refusals_name_the_field_in_a_config_without_pad_token_id():
    """Today's refusals stand in the published DeepSeek-V3 shape: the refused field is named, not a missing one."""
    raw = {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "quantization_config"}
    for changes, field in (
        (dict(attention_bias=True), "attention_bias"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(topk_method="greedy"), "topk_method"),
        (dict(n_group=None), "n_group"),
        (dict(topk_group=9), "topk_group"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling type 'linear'"),
    ):
        with pytest.raises(ConfigError, match=field):
            ModelConfig.from_hf_dict(dict(raw, **changes))


def drafter_raw(**changes):
    raw = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        num_target_layers=8,
        dflash_config=dict(mask_token_id=62, target_layer_ids=[1, 5]),
    )
    return {k: v for k, v in dict(raw, **changes).items() if v is not None}


def test_drafter_absent_fields_take_qwen3_defaults():
    """Qwen3Config (src/transformers/models/qwen3/configuration_qwen3.py): rms_norm_eps 1e-6, rope_theta 10000,
    max_position_embeddings 32768 (YaRN's original length when neither is given)."""
    cfg = DrafterConfig.from_dict(drafter_raw())
    assert (cfg.rms_norm_eps, cfg.rope.theta, cfg.rope.kind) == (1e-6, 10000.0, "default")
    yarn = DrafterConfig.from_dict(drafter_raw(rope_scaling=dict(type="yarn", factor=4.0))).rope
    assert (yarn.theta, yarn.factor, yarn.original_max_position_embeddings) == (10000.0, 4.0, 32768)
    with pytest.raises(ConfigError, match="rope_theta"):
        DrafterConfig.from_dict(dict(drafter_raw(), rope_theta=None))


@pytest.mark.parametrize(
    "field,value,said",
    [
        ("num_hidden_layers", 0, "must be >= 1, got 0"),
        ("num_hidden_layers", -3, "must be >= 1, got -3"),
        ("hidden_size", 0, "must be >= 1"),
        ("vocab_size", -1, "must be >= 1"),
        ("first_k_dense_replace", -1, "must be >= 0"),
        ("n_routed_experts", -16, "must be >= 0"),
    ],
)
def test_a_size_out_of_range_is_refused_by_name(field, value, said):
    with pytest.raises(ConfigError, match=f"{field}: {said}"):
        ModelConfig.from_hf_dict(dict(preset_text_config("tiny"), **{field: value}))


def test_a_missing_or_file_checkpoint_path_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="gone: no such checkpoint directory"):
        ModelConfig.from_hf_dir(str(tmp_path / "gone"))
    with pytest.raises(ConfigError, match="file: not a directory"):
        ModelConfig.from_hf_dir(str(tmp_path / "file"))
