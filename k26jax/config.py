"""Model configuration: built from a Hugging Face `config.json`, or from a preset.

Accepts the K2.5/K2.6 `kimi_k25` wrapper (text config under `text_config`, `quantization_config` at either
level) and plain text configs whose `model_type` is `kimi_k2` or `deepseek_v3`. A field the text config leaves out
takes transformers' `DeepseekV3Config` default (`HF_TEXT_DEFAULTS`), as transformers itself would read the file.
Every field the math depends on is honoured; a value we cannot honour raises `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

TEXT_MODEL_TYPES = ("kimi_k2", "deepseek_v3")
WRAPPER_MODEL_TYPE = "kimi_k25"


class ConfigError(ValueError):
    """A config.json that k26jax cannot honour exactly."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters (`rope_scaling` / `rope_parameters` with type yarn)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """compressed-tensors pack-quantized INT4 (the only scheme k26jax implements)."""

    num_bits: int = 4
    group_size: int = 32
    symmetric: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    quant: QuantConfig | None = QuantConfig()
    latent_norm_eps: float = 1e-6  # q_a / kv_a layernorms: HF's DeepseekV3RMSNorm default, not rms_norm_eps

    # ---- derived --------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one latent-cache row: normalised c_kv, then roped k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple("moe" if self.is_moe_layer(i) else "dense" for i in range(self.num_hidden_layers))

    @property
    def num_dense_layers(self) -> int:
        return self.layer_kinds.count("dense")

    @property
    def num_moe_layers(self) -> int:
        return self.layer_kinds.count("moe")

    @property
    def softmax_scale(self) -> float:
        """192^-0.5 times the YaRN mscale squared (HF applies it whenever mscale_all_dim is set)."""
        scale = self.qk_head_dim**-0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale = scale * m * m
        return scale

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        config_path, raw = read_config_json(path, "checkpoint")
        cfg = cls.from_hf_dict(raw, source=config_path)
        extra_eos = [e for e in _read_generation_eos(path) if e not in cfg.eos_token_ids]
        return cfg.replace(eos_token_ids=cfg.eos_token_ids + tuple(extra_eos))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        text, quant_raw = _unwrap(raw, source)
        _check_fixed_fields(text, source)
        ids = _token_ids(text, raw)
        f, tokens = _Fields(text, source), _Fields(ids, source)
        max_position_embeddings = f.int("max_position_embeddings")
        cfg = cls(
            vocab_size=f.int("vocab_size"),
            hidden_size=f.int("hidden_size"),
            intermediate_size=f.int("intermediate_size"),
            moe_intermediate_size=f.int("moe_intermediate_size"),
            num_hidden_layers=f.int("num_hidden_layers"),
            num_attention_heads=f.int("num_attention_heads"),
            q_lora_rank=f.int("q_lora_rank", nullable=True),
            kv_lora_rank=f.int("kv_lora_rank"),
            qk_nope_head_dim=f.int("qk_nope_head_dim"),
            qk_rope_head_dim=f.int("qk_rope_head_dim"),
            v_head_dim=f.int("v_head_dim"),
            n_routed_experts=f.int("n_routed_experts", nullable=True) or 0,
            n_shared_experts=f.int("n_shared_experts", nullable=True) or 0,
            num_experts_per_tok=f.int("num_experts_per_tok", nullable=True) or 0,
            first_k_dense_replace=f.int("first_k_dense_replace"),
            moe_layer_freq=f.int("moe_layer_freq"),
            n_group=f.int("n_group"),
            topk_group=f.int("topk_group"),
            norm_topk_prob=f.bool("norm_topk_prob"),
            routed_scaling_factor=f.float("routed_scaling_factor"),
            rms_norm_eps=f.float("rms_norm_eps"),
            rope_theta=_rope_theta(text, source),
            rope_scaling=_rope_scaling(text, max_position_embeddings, source),
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=f.bool("tie_word_embeddings"),
            scoring_func=f.str("scoring_func"),
            topk_method=f.str("topk_method"),
            bos_token_id=tokens.int("bos_token_id", nullable=True),
            eos_token_ids=_as_tuple(ids["eos_token_id"]),
            pad_token_id=tokens.int("pad_token_id", nullable=True),
            quant=_quant(quant_raw, source),
        )
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        def bad(field, msg):
            raise ConfigError(f"{source}: {field}: {msg}")

        for name in POSITIVE_SIZES:
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("q_lora_rank", "n_routed_experts", "n_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if value is not None and value < 0:
                bad(name, f"must be >= 0, got {value}")
        if self.scoring_func != "sigmoid":
            bad("scoring_func", f"{self.scoring_func!r} is not supported (only 'sigmoid', as in K2/K2.6)")
        if self.topk_method != "noaux_tc":
            bad("topk_method", f"{self.topk_method!r} is not supported (only 'noaux_tc')")
        if self.moe_layer_freq < 1:
            bad("moe_layer_freq", f"must be >= 1, got {self.moe_layer_freq}")
        if self.n_routed_experts:
            if self.num_experts_per_tok < 1 or self.num_experts_per_tok > self.n_routed_experts:
                bad("num_experts_per_tok", f"{self.num_experts_per_tok} not in [1, {self.n_routed_experts}]")
            if self.n_group < 1 or self.n_routed_experts % self.n_group:
                bad("n_group", f"{self.n_group} does not divide n_routed_experts={self.n_routed_experts}")
            if not 1 <= self.topk_group <= self.n_group:
                bad("topk_group", f"{self.topk_group} not in [1, n_group={self.n_group}]")
            if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                bad("n_group", "group-limited routing needs >= 2 experts per group (top-2 group score)")
            if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
                bad("num_experts_per_tok", "more than the experts of the kept groups")
        if self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", "must be even (interleaved rope pairs)")
        if self.quant is not None:
            g = self.quant.group_size
            for name in ("hidden_size", "moe_intermediate_size"):
                if getattr(self, name) % g:
                    bad(name, f"{getattr(self, name)} is not a multiple of the quantization group {g}")
        if self.rope_scaling is not None and self.rope_scaling.factor <= 0:
            bad("rope_scaling.factor", "must be > 0")


def read_config_json(path, what: str) -> tuple[str, dict[str, Any]]:
    """(path of DIR/config.json, its parsed contents); a missing or malformed file raises ConfigError."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise ConfigError(f"{path}: " + ("not a directory" if os.path.exists(path) else f"no such {what} directory"))
    if not os.path.isfile(config_path):
        raise ConfigError(f"{config_path}: no config.json in the {what} directory")
    try:
        with open(config_path) as f:
            return config_path, json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{config_path}: not valid JSON ({e})") from e


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# ---- presets --------------------------------------------------------------------------------------------
K26_TEXT_CONFIG: dict[str, Any] = dict(
    model_type="kimi_k2",
    vocab_size=163840,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=384,
    n_shared_experts=1,
    num_experts_per_tok=8,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.827,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    rms_norm_eps=1e-5,
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
    max_position_embeddings=262144,
    tie_word_embeddings=False,
    hidden_act="silu",
    attention_bias=False,
    bos_token_id=163584,
    eos_token_id=163585,
    pad_token_id=163839,
)

# Tiny: shards 8 ways under both expert layouts (experts % 8 == 0, moe_intermediate % 256 == 0, heads % 8 == 0).
# Special tokens keep K2's offsets from the top of the vocabulary (K2: 163584 = V - 256).
TINY_TEXT_CONFIG: dict[str, Any] = dict(
    K26_TEXT_CONFIG,
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=16,
    num_experts_per_tok=4,
    max_position_embeddings=4096,
    bos_token_id=768,
    eos_token_id=769,
    pad_token_id=1023,
)

# k26-mini: the K2.6 architecture at CPU size (the embedded trained pair, k26jax/train/mini.py); the INT4
# checkpoint plus its drafter stays under 25 MB. Its 4096 ids end in K2's 256 special tokens.
MINI_TEXT_CONFIG: dict[str, Any] = dict(
    TINY_TEXT_CONFIG,
    vocab_size=4096,
    intermediate_size=1024,
    num_hidden_layers=6,
    q_lora_rank=128,
    max_position_embeddings=K26_TEXT_CONFIG["max_position_embeddings"],
    bos_token_id=3840,
    eos_token_id=3841,
    pad_token_id=4095,
)

QUANT_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "observer": "minmax",
            },
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}


def preset_text_config(name: str) -> dict[str, Any]:
    """The text config dict of a preset: `k26`, `k26-depthN` (full width, N layers), `k26-mini` or `tiny`."""
    if name == "k26":
        return dict(K26_TEXT_CONFIG)
    if name == "tiny":
        return dict(TINY_TEXT_CONFIG)
    if name == "k26-mini":
        return dict(MINI_TEXT_CONFIG)
    m = re.fullmatch(r"k26-depth(\d+)", name)
    if m and int(m.group(1)) >= 1:
        return dict(K26_TEXT_CONFIG, num_hidden_layers=int(m.group(1)))
    raise ConfigError(f"unknown preset {name!r}: use 'k26', 'k26-depthN' (N >= 1), 'k26-mini' or 'tiny'")


def preset(name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(
        dict(preset_text_config(name), quantization_config=QUANT_CONFIG), source=f"preset {name}"
    )


# ---- parsing helpers ------------------------------------------------------------------------------------
def _unwrap(raw: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    model_type = raw.get("model_type")
    if model_type == WRAPPER_MODEL_TYPE:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: model_type 'kimi_k25' wrapper has no 'text_config' object")
        inner = text.get("model_type", "kimi_k2")
        if inner not in TEXT_MODEL_TYPES:
            raise ConfigError(f"{source}: text_config.model_type {inner!r} is not one of {TEXT_MODEL_TYPES}")
        return text, text.get("quantization_config", raw.get("quantization_config"))
    if model_type in TEXT_MODEL_TYPES:
        return raw, raw.get("quantization_config")
    raise ConfigError(
        f"{source}: unknown model_type {model_type!r}; expected 'kimi_k25' (wrapper), 'kimi_k2' or 'deepseek_v3'"
    )


# transformers' DeepseekV3Config defaults: src/transformers/models/deepseek_v3/configuration_deepseek_v3.py
# (the same values in v4.57.1 and v5.24.0; rope_theta is v5's RotaryEmbeddingConfigMixin.default_theta). kimi_k2
# text configs read the same way: transformers' Kimi_K25Config (models/kimi_k25/configuration_kimi_k25.py) builds
# its text_config as a DeepseekV3Config. moe_layer_freq, scoring_func and topk_method are not DeepseekV3Config
# fields; transformers' DeepseekV3 model acts as 1 / sigmoid / noaux_tc, the defaults of DeepSeek-V3's own
# configuration_deepseek.py.
HF_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    pad_token_id=None,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    rope_interleave=True,
    attention_bias=False,
    moe_layer_freq=1,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
)
# Fields k26jax implements at one value only (their default): any other value is refused.
_FIXED_FIELDS = ("hidden_act", "attention_bias", "rope_interleave")


def _check_fixed_fields(text: dict[str, Any], source: str) -> None:
    for key in _FIXED_FIELDS:
        want = HF_TEXT_DEFAULTS[key]
        if key in text and text[key] != want:
            raise ConfigError(f"{source}: {key}: {text[key]!r} is not supported (only {want!r})")
    heads = text.get("num_attention_heads", HF_TEXT_DEFAULTS["num_attention_heads"])
    kv_heads = text.get("num_key_value_heads", HF_TEXT_DEFAULTS["num_key_value_heads"])
    if kv_heads is not None and kv_heads != heads:
        given = "" if "num_key_value_heads" in text else " (absent: transformers' default)"
        raise ConfigError(
            f"{source}: num_key_value_heads: {kv_heads}{given} != num_attention_heads={heads}; MLA needs them equal"
        )
    partial = text.get("partial_rotary_factor")
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{source}: partial_rotary_factor: {partial} is not supported (only full rotary)")


def _token_ids(text: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    """bos/eos/pad ids: the text config's, else the kimi_k25 wrapper's, else DeepseekV3Config's defaults."""
    return {
        key: text[key] if key in text else raw.get(key, HF_TEXT_DEFAULTS[key])
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
    }


POSITIVE_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "max_position_embeddings",
)


class _Fields:
    """Typed reads of a config dict; an absent key takes its HF_TEXT_DEFAULTS value."""

    def __init__(self, d: dict[str, Any], source: str):
        self.d, self.source = d, source

    def _get(self, key):
        return self.d[key] if key in self.d else HF_TEXT_DEFAULTS[key]

    def int(self, key, nullable=False):
        v = self._get(key)
        if v is None and nullable:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{self.source}: {key}: expected an integer, got {v!r}")
        return v

    def float(self, key):
        return _number(self._get(key), key, self.source)

    def bool(self, key):
        v = self._get(key)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.source}: {key}: expected true/false, got {v!r}")
        return v

    def str(self, key):
        v = self._get(key)
        if not isinstance(v, str):
            raise ConfigError(f"{self.source}: {key}: expected a string, got {v!r}")
        return v


def _number(v, key: str, source: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{source}: {key}: expected a number, got {v!r}")
    return float(v)


def _rope_dict(text: dict[str, Any]) -> dict[str, Any] | None:
    """`rope_scaling` (transformers 4) or `rope_parameters` (transformers 5), whichever the config has."""
    rs = text.get("rope_scaling")
    if rs is None and isinstance(text.get("rope_parameters"), dict):
        rs = text["rope_parameters"]
    return rs


def _rope_theta(text: dict[str, Any], source: str) -> float:
    """Top-level rope_theta or the rope dict's (transformers 4 reads the first, 5 the second: they must agree)."""
    rs = _rope_dict(text)
    inner = rs.get("rope_theta") if isinstance(rs, dict) else None
    if "rope_theta" in text and inner is not None and text["rope_theta"] != inner:
        raise ConfigError(f"{source}: rope_theta: {text['rope_theta']} at the top level, {inner} in the rope dict")
    if "rope_theta" in text:
        return _number(text["rope_theta"], "rope_theta", source)
    return _number(HF_TEXT_DEFAULTS["rope_theta"] if inner is None else inner, "rope_theta", source)


def _rope_scaling(text: dict[str, Any], max_position_embeddings: int, source: str) -> RopeScaling | None:
    """YaRN parameters with transformers' defaults: original_max_position_embeddings falls back to
    max_position_embeddings, beta_fast/beta_slow to 32/1 when absent or zero, mscale/mscale_all_dim unset."""
    rs = _rope_dict(text)
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"{source}: rope_scaling: expected an object, got {rs!r}")
    kind = rs.get("type", rs.get("rope_type"))
    if kind in (None, "default") and "factor" not in rs:
        return None
    if kind != "yarn":
        raise ConfigError(f"{source}: rope_scaling type {kind!r} is not supported (only 'yarn' or none)")

    def bad(key, msg):
        raise ConfigError(f"{source}: rope_scaling.{key}: {msg}")

    if "factor" not in rs:
        raise ConfigError(f"{source}: rope_scaling (yarn) lacks 'factor'")
    factor = _number(rs["factor"], "rope_scaling.factor", source)
    original = rs.get("original_max_position_embeddings", max_position_embeddings)
    if isinstance(original, bool) or not isinstance(original, int):
        bad("original_max_position_embeddings", f"expected an integer, got {original!r}")
    top = text.get("original_max_position_embeddings")
    if top is not None and top != original:
        bad("original_max_position_embeddings", f"{original}, but {top} at the top level")
    mscale, mscale_all_dim = (rs.get(k) or 0.0 for k in ("mscale", "mscale_all_dim"))
    if mscale_all_dim and not mscale:
        bad(
            "mscale",
            "mscale_all_dim without mscale is not supported (transformers then scales cos/sin by factor alone, "
            "DeepSeek's reference code with mscale=1)",
        )
    for key in ("partial_rotary_factor", "truncate"):
        if rs.get(key, True) not in (1, True):
            bad(key, f"{rs[key]!r} is not supported")
    cfg = RopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=_number(rs.get("beta_fast") or 32.0, "rope_scaling.beta_fast", source),
        beta_slow=_number(rs.get("beta_slow") or 1.0, "rope_scaling.beta_slow", source),
        mscale=_number(mscale or 1.0, "rope_scaling.mscale", source),
        mscale_all_dim=_number(mscale_all_dim, "rope_scaling.mscale_all_dim", source),
    )
    attention_factor = rs.get("attention_factor")
    if attention_factor is not None:
        derived = (
            yarn_mscale(factor, cfg.mscale) / yarn_mscale(factor, mscale_all_dim)
            if mscale_all_dim
            else yarn_mscale(factor)
        )
        if not math.isclose(_number(attention_factor, "rope_scaling.attention_factor", source), derived):
            bad("attention_factor", f"{attention_factor} differs from {derived} derived from factor and mscale")
    return cfg


def _quant(q: dict[str, Any] | None, source: str) -> QuantConfig | None:
    if q is None:
        return None
    method, fmt = q.get("quant_method"), q.get("format")
    if method != "compressed-tensors" or fmt != "pack-quantized":
        raise ConfigError(
            f"{source}: quantization_config: quant_method={method!r} format={fmt!r} is not "
            f"supported; k26jax implements compressed-tensors 'pack-quantized' INT4 only "
            f"(FP8 block checkpoints such as K2-Instruct are refused)"
        )
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"{source}: quantization_config.config_groups: expected one group, got {len(groups)}")
    ((name, group),) = groups.items()
    w = group.get("weights") or {}
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    for key, value in want.items():
        if w.get(key) != value:
            raise ConfigError(
                f"{source}: quantization_config.config_groups.{name}.weights.{key} = "
                f"{w.get(key)!r}; only {value!r} is supported (INT4, group 32, symmetric)"
            )
    if group.get("input_activations") is not None:
        raise ConfigError(f"{source}: quantization_config: activation quantization is not supported")
    return QuantConfig()


def _as_tuple(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (int(v),)


def _read_generation_eos(path) -> tuple[int, ...]:
    gen = os.path.join(path, "generation_config.json")
    if not os.path.isfile(gen):
        return ()
    with open(gen) as f:
        return _as_tuple(json.load(f).get("eos_token_id"))


# ---- DFlash drafter --------------------------------------------------------------------------------------
DRAFTER_ARCHITECTURE = "DFlashDraftModel"
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_REQUIRED = object()
# transformers' Qwen3Config defaults (src/transformers/models/qwen3/configuration_qwen3.py, the same in v4.57.1 and
# v5.24.0) for the drafter fields that take one: a DFlash config is a Qwen3 config. Shapes stay required (they must
# match the drafter's weights and the target), and so do head_dim and num_key_value_heads: Qwen3Config's 128 and 32
# are Qwen3-8B's, where an absent num_key_value_heads here means num_attention_heads.
QWEN3_DRAFTER_DEFAULTS: dict[str, Any] = dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768)


@dataclasses.dataclass(frozen=True)
class DrafterRope:
    """The drafter's rope, with HF `Qwen3RotaryEmbedding` semantics (rotate-half layout, not K2's interleaved).

    kind "default": inv_freq = theta^(-2i/d). kind "yarn": HF's YaRN blend of interpolated and extrapolated
    frequencies over the correction range [low, high] (floored/ceiled when `truncate`). cos and sin are
    multiplied by `attention_factor` (HF's attention_scaling), resolved from attention_factor / mscale /
    mscale_all_dim / factor exactly as HF does when the config is read.
    """

    theta: float
    kind: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def to_hf_scaling(self) -> dict[str, Any] | None:
        if self.kind == "default":
            return None
        out = dict(
            type="yarn",
            rope_type="yarn",
            factor=self.factor,
            original_max_position_embeddings=self.original_max_position_embeddings,
            beta_fast=self.beta_fast,
            beta_slow=self.beta_slow,
            attention_factor=self.attention_factor,
        )
        if not self.truncate:
            out["truncate"] = False
        return out


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A z-lab DFlash drafter (`DFlashDraftModel`, dflash 0.1.0): Qwen3 layers with KV injection of target features.

    Fields the reference reads from `dflash_config` first, then from the top level: block_size, mask_token_id,
    target_layer_ids, output_multiplier, final_logit_softcapping, input_embedding_scale. When target_layer_ids is
    absent it is derived from num_target_layers (`build_target_layer_ids`). An absent rms_norm_eps, rope_theta or
    max_position_embeddings (for YaRN's original length) takes Qwen3Config's default. Values the reference would
    honour but k26jax does not (causal or sliding-window attention, biases, other activations, other rope types,
    DFlash2's convs and selector) raise ConfigError naming the field.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: DrafterRope
    block_size: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    mask_token_id: int
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None  # None: no softcap (the reference skips values <= 0 too)
    input_embedding_scale: float = 1.0  # multiplies the target's embedding of the block tokens

    def __post_init__(self):
        self.validate()

    @property
    def context_dim(self) -> int:
        """Width of the context features: hidden states of len(target_layer_ids) target layers, concatenated."""
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def validate(self, source: str = "drafter config") -> None:
        def bad(field, msg):
            raise ConfigError(f"{source}: {field}: {msg}")

        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "num_target_layers",
        ):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            bad(
                "num_key_value_heads",
                f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}",
            )
        if self.head_dim % 2:
            bad("head_dim", f"must be even for rope, got {self.head_dim}")
        if self.block_size < 2:
            bad("block_size", f"must be >= 2 (bonus token + at least one draft), got {self.block_size}")
        if not self.target_layer_ids or any(i < 0 for i in self.target_layer_ids):
            bad("target_layer_ids", f"must be a non-empty list of layer indices >= 0, got {self.target_layer_ids}")
        if self.mask_token_id < 0 or (self.vocab_size is not None and self.mask_token_id >= self.vocab_size):
            bad("mask_token_id", f"{self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.rms_norm_eps <= 0:
            bad("rms_norm_eps", f"must be > 0, got {self.rms_norm_eps}")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            bad("final_logit_softcapping", "must be > 0 or None")
        if self.rope.kind not in ("default", "yarn"):
            bad("rope_scaling", f"type {self.rope.kind!r} is not supported (only default or 'yarn')")
        if self.rope.kind == "yarn" and (self.rope.factor <= 0 or not self.rope.original_max_position_embeddings):
            bad("rope_scaling", "yarn needs factor > 0 and original_max_position_embeddings")

    def check_target(self, target) -> None:
        """Raise ConfigError naming the field when this drafter cannot run on `target` (a ModelConfig)."""

        def bad(field, msg):
            raise ConfigError(f"drafter does not fit the target: {field}: {msg}")

        if self.hidden_size != target.hidden_size:
            bad(
                "hidden_size",
                f"drafter {self.hidden_size} != target {target.hidden_size} (the drafter consumes "
                f"target hidden states and the target's embedding)",
            )
        if self.vocab_size is not None and self.vocab_size != target.vocab_size:
            bad("vocab_size", f"drafter {self.vocab_size} != target {target.vocab_size}")
        if self.mask_token_id >= target.vocab_size:
            bad("mask_token_id", f"{self.mask_token_id} is outside the target vocabulary [0, {target.vocab_size})")
        if max(self.target_layer_ids) >= target.num_hidden_layers:
            bad(
                "target_layer_ids",
                f"{list(self.target_layer_ids)} reach past the target's {target.num_hidden_layers} layers",
            )

    # ---- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "DrafterConfig":
        config_path, raw = read_config_json(path, "drafter")
        return cls.from_dict(raw, source=config_path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "drafter config") -> "DrafterConfig":
        def bad(field, msg):
            raise ConfigError(f"{source}: {field}: {msg}")

        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            bad("dflash_config", f"expected an object, got {dflash!r}")
        _refuse_unsupported(raw, dflash, bad)

        def get(key, kind, default=_REQUIRED, in_dflash=False):
            if in_dflash and key in dflash:
                name, value = f"dflash_config.{key}", dflash[key]
            elif key in raw:
                name, value = key, raw[key]
            elif default is _REQUIRED:
                bad(key, "required field is missing")
            else:
                return default
            if value is None and default is None:
                return None
            ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
            if isinstance(value, bool) or not ok:
                bad(name, f"expected {'an integer' if kind is int else 'a number'}, got {value!r}")
            return kind(value)

        num_layers, num_target = get("num_hidden_layers", int), get("num_target_layers", int)
        layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        if layer_ids is None:
            layer_ids = build_target_layer_ids(num_target, num_layers)
        elif not isinstance(layer_ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in layer_ids
        ):
            bad("target_layer_ids", f"expected a list of integers, got {layer_ids!r}")
        heads = get("num_attention_heads", int)
        softcap = get("final_logit_softcapping", float, None, in_dflash=True)
        return cls(
            hidden_size=get("hidden_size", int),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads", int, None) or heads,
            head_dim=get("head_dim", int),
            intermediate_size=get("intermediate_size", int),
            rms_norm_eps=get("rms_norm_eps", float, QWEN3_DRAFTER_DEFAULTS["rms_norm_eps"]),
            rope=_drafter_rope(raw, bad),
            block_size=get("block_size", int, 16, in_dflash=True),
            target_layer_ids=tuple(layer_ids),
            num_target_layers=num_target,
            mask_token_id=get("mask_token_id", int, in_dflash=True),
            vocab_size=get("vocab_size", int, None),
            max_position_embeddings=get("max_position_embeddings", int, None),
            output_multiplier=get("output_multiplier", float, 1.0, in_dflash=True),
            final_logit_softcapping=softcap if softcap is not None and softcap > 0 else None,
            input_embedding_scale=get("input_embedding_scale", float, 1.0, in_dflash=True),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json in z-lab's layout, readable by dflash's DFlashDraftModel (transformers 4.x and 5.x)."""
        dflash = dict(mask_token_id=self.mask_token_id, target_layer_ids=list(self.target_layer_ids))
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.input_embedding_scale != 1.0:
            dflash["input_embedding_scale"] = self.input_embedding_scale
        out = dict(
            architectures=[DRAFTER_ARCHITECTURE],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            attention_bias=False,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope.theta,
            num_target_layers=self.num_target_layers,
            block_size=self.block_size,
            tie_word_embeddings=False,
            dflash_config=dflash,
        )
        if self.rope.kind != "default":
            out["rope_scaling"] = self.rope.to_hf_scaling()
        for key in ("vocab_size", "max_position_embeddings"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    def replace(self, **changes) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """dflash's default choice of target layers: spread over [1, n_target - 3] (Python's round, half to even)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _refuse_unsupported(raw: dict[str, Any], dflash: dict[str, Any], bad) -> None:
    archs = raw.get("architectures") or [DRAFTER_ARCHITECTURE]
    if any(a != DRAFTER_ARCHITECTURE for a in archs):
        bad(
            "architectures",
            f"{archs}: only {DRAFTER_ARCHITECTURE} is implemented (DFlash2DraftModel adds "
            f"causal convs and a candidate selector)",
        )
    for key in _DFLASH2_FIELDS:
        if key in raw or key in dflash:
            bad(key, "DFlash2 (causal convs + candidate selector) is not implemented")
    if raw.get("hidden_act", "silu") != "silu":
        bad("hidden_act", f"{raw['hidden_act']!r} is not supported (only 'silu')")
    if raw.get("attention_bias", False):
        bad("attention_bias", "q/k/v/o biases are not supported")
    if raw.get("is_causal") or dflash.get("is_causal"):
        bad("is_causal", "causal drafter attention is not supported (DFlash attends non-causally)")
    if raw.get("use_sliding_window", False):
        bad("use_sliding_window", "sliding-window drafter attention is not supported")
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        bad("layer_types", f"{layer_types}: only 'full_attention' is supported")


def _drafter_rope(raw: dict[str, Any], bad) -> DrafterRope:
    """HF's rope_parameters (transformers 5) or rope_theta + rope_scaling (legacy), resolved as HF resolves them."""
    params = raw.get("rope_parameters")
    field = "rope_parameters"
    if not isinstance(params, dict):
        params, field = dict(raw.get("rope_scaling") or {}), "rope_scaling"
    if any(isinstance(v, dict) for v in params.values()):
        bad(field, "rope parameters per layer type are not supported")
    theta = next((d["rope_theta"] for d in (params, raw) if "rope_theta" in d), QWEN3_DRAFTER_DEFAULTS["rope_theta"])
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        bad("rope_theta", f"required number, got {theta!r}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        bad("partial_rotary_factor", f"{partial} is not supported (only full rotary)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return DrafterRope(theta=float(theta))
    if kind != "yarn":
        bad(field, f"rope type {kind!r} is not supported (only default or 'yarn')")
    max_pos = raw.get("max_position_embeddings", QWEN3_DRAFTER_DEFAULTS["max_position_embeddings"])
    original = raw.get("original_max_position_embeddings", params.get("original_max_position_embeddings", max_pos))
    factor = params.get("factor")
    if original is None or (factor is None and max_pos is None):
        bad(field, "yarn needs original_max_position_embeddings and factor (or max_position_embeddings)")
    factor = float(max_pos / original if factor is None else factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            if mscale and mscale_all_dim
            else yarn_mscale(factor)
        )
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        bad(f"{field}.truncate", f"expected true/false, got {truncate!r}")
    return DrafterRope(
        theta=float(theta),
        kind="yarn",
        factor=factor,
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=truncate,
        attention_factor=float(attention_factor),
    )
