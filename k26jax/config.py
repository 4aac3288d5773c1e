"""Model configuration: built from a Hugging Face `config.json`, or from a preset.

Accepts the K2.5/K2.6 `kimi_k25` wrapper (text config under `text_config`, `quantization_config` at either
level) and plain text configs whose `model_type` is `kimi_k2` or `deepseek_v3`. Every field the math depends on is
honoured; a value we cannot honour raises `ConfigError` naming the field. Nothing is silently defaulted.
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
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

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
        scale = self.qk_head_dim ** -0.5
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale = scale * m * m
        return scale

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- construction ---------------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ConfigError(f"{config_path}: no config.json in the checkpoint directory")
        try:
            with open(config_path) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{config_path}: not valid JSON ({e})") from e
        cfg = cls.from_hf_dict(raw, source=config_path)
        extra_eos = [e for e in _read_generation_eos(path) if e not in cfg.eos_token_ids]
        return cfg.replace(eos_token_ids=cfg.eos_token_ids + tuple(extra_eos))

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        text, quant_raw = _unwrap(raw, source)
        f = _Fields(text, source)
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
            first_k_dense_replace=f.int("first_k_dense_replace", default=0),
            moe_layer_freq=f.int("moe_layer_freq", default=1),
            n_group=f.int("n_group", default=1),
            topk_group=f.int("topk_group", default=1),
            norm_topk_prob=f.bool("norm_topk_prob"),
            routed_scaling_factor=f.float("routed_scaling_factor", default=1.0),
            rms_norm_eps=f.float("rms_norm_eps"),
            rope_theta=f.float("rope_theta", alt=("rope_parameters", "rope_theta")),
            rope_scaling=_rope_scaling(text, source),
            max_position_embeddings=f.int("max_position_embeddings"),
            tie_word_embeddings=f.bool("tie_word_embeddings", default=False),
            scoring_func=f.str("scoring_func", default="sigmoid"),
            topk_method=f.str("topk_method", default="noaux_tc"),
            bos_token_id=f.int("bos_token_id", nullable=True),
            eos_token_ids=_as_tuple(text.get("eos_token_id", raw.get("eos_token_id"))),
            pad_token_id=f.int("pad_token_id", nullable=True),
            quant=_quant(quant_raw, source),
        )
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config") -> None:
        def bad(field, msg):
            raise ConfigError(f"{source}: {field}: {msg}")

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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# ---- presets --------------------------------------------------------------------------------------------
K26_TEXT_CONFIG: dict[str, Any] = dict(
    model_type="kimi_k2", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
    moe_layer_freq=1, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.827,
    scoring_func="sigmoid", topk_method="noaux_tc", rms_norm_eps=1e-5, rope_theta=50000.0,
    rope_scaling=dict(type="yarn", factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0,
                      beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    max_position_embeddings=262144, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
    bos_token_id=163584, eos_token_id=163585, pad_token_id=163839,
)

# Tiny: shards 8 ways under both expert layouts (experts % 8 == 0, moe_intermediate % 256 == 0, heads % 8 == 0).
# Special tokens keep K2's offsets from the top of the vocabulary (K2: 163584 = V - 256).
TINY_TEXT_CONFIG: dict[str, Any] = dict(
    K26_TEXT_CONFIG, vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=96, kv_lora_rank=64,
    qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4,
    max_position_embeddings=4096, bos_token_id=768, eos_token_id=769, pad_token_id=1023,
)

QUANT_CONFIG: dict[str, Any] = {
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "observer": "minmax"}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}


def preset_text_config(name: str) -> dict[str, Any]:
    """The text config dict of a preset: `k26`, `k26-depthN` (full width, N layers) or `tiny`."""
    if name == "k26":
        return dict(K26_TEXT_CONFIG)
    if name == "tiny":
        return dict(TINY_TEXT_CONFIG)
    m = re.fullmatch(r"k26-depth(\d+)", name)
    if m and int(m.group(1)) >= 1:
        return dict(K26_TEXT_CONFIG, num_hidden_layers=int(m.group(1)))
    raise ConfigError(f"unknown preset {name!r}: use 'k26', 'k26-depthN' (N >= 1) or 'tiny'")


def preset(name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(preset_text_config(name), quantization_config=QUANT_CONFIG),
                                    source=f"preset {name}")


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
    raise ConfigError(f"{source}: unknown model_type {model_type!r}; expected 'kimi_k25' (wrapper), "
                      f"'kimi_k2' or 'deepseek_v3'")


class _Fields:
    _MISSING = object()

    def __init__(self, d: dict[str, Any], source: str):
        self.d, self.source = d, source
        for key, want in (("hidden_act", "silu"), ("attention_bias", False)):
            if key in d and d[key] != want:
                raise ConfigError(f"{source}: {key}: {d[key]!r} is not supported (only {want!r})")
        heads, kv_heads = d.get("num_attention_heads"), d.get("num_key_value_heads")
        if kv_heads is not None and kv_heads != heads:
            raise ConfigError(f"{source}: num_key_value_heads: MLA needs it equal to num_attention_heads")

    def _get(self, key, default, alt=None):
        if key in self.d:
            return self.d[key]
        if alt and isinstance(self.d.get(alt[0]), dict) and alt[1] in self.d[alt[0]]:
            return self.d[alt[0]][alt[1]]
        if default is self._MISSING:
            raise ConfigError(f"{self.source}: required field {key!r} is missing")
        return default

    def int(self, key, default=_MISSING, nullable=False, alt=None):
        v = self._get(key, default, alt)
        if v is None and (nullable or default is None):
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{self.source}: {key}: expected an integer, got {v!r}")
        return v

    def float(self, key, default=_MISSING, alt=None):
        v = self._get(key, default, alt)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{self.source}: {key}: expected a number, got {v!r}")
        return float(v)

    def bool(self, key, default=_MISSING):
        v = self._get(key, default)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.source}: {key}: expected true/false, got {v!r}")
        return v

    def str(self, key, default=_MISSING):
        v = self._get(key, default)
        if not isinstance(v, str):
            raise ConfigError(f"{self.source}: {key}: expected a string, got {v!r}")
        return v


def _rope_scaling(text: dict[str, Any], source: str) -> RopeScaling | None:
    rs = text.get("rope_scaling")
    if rs is None and isinstance(text.get("rope_parameters"), dict):
        rs = text["rope_parameters"]
    if rs is None:
        return None
    kind = rs.get("type", rs.get("rope_type"))
    if kind in (None, "default") and "factor" not in rs:
        return None
    if kind != "yarn":
        raise ConfigError(f"{source}: rope_scaling type {kind!r} is not supported (only 'yarn' or none)")
    try:
        return RopeScaling(
            factor=float(rs["factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
            beta_fast=float(rs.get("beta_fast", 32.0)), beta_slow=float(rs.get("beta_slow", 1.0)),
            mscale=float(rs.get("mscale", 1.0)), mscale_all_dim=float(rs.get("mscale_all_dim", 0.0)))
    except KeyError as e:
        raise ConfigError(f"{source}: rope_scaling (yarn) lacks {e.args[0]!r}") from e


def _quant(q: dict[str, Any] | None, source: str) -> QuantConfig | None:
    if q is None:
        return None
    method, fmt = q.get("quant_method"), q.get("format")
    if method != "compressed-tensors" or fmt != "pack-quantized":
        raise ConfigError(f"{source}: quantization_config: quant_method={method!r} format={fmt!r} is not "
                          f"supported; k26jax implements compressed-tensors 'pack-quantized' INT4 only "
                          f"(FP8 block checkpoints such as K2-Instruct are refused)")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise ConfigError(f"{source}: quantization_config.config_groups: expected one group, got {len(groups)}")
    (name, group), = groups.items()
    w = group.get("weights") or {}
    want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    for key, value in want.items():
        if w.get(key) != value:
            raise ConfigError(f"{source}: quantization_config.config_groups.{name}.weights.{key} = "
                              f"{w.get(key)!r}; only {value!r} is supported (INT4, group 32, symmetric)")
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
