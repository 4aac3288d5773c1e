"""The k26-mini pair: a K2.6-architecture target small enough to decode fast on a CPU, and its DFlash drafter.

Sized so the INT4 checkpoint plus the bf16 drafter stays under 25 MB: 6 layers (first dense, then 5 MoE), hidden
256, 16 routed experts top-4 with moe_intermediate 256 (8-way tensor-parallel experts keep whole INT4 groups of
32), 8 heads, kv_lora_rank 64 and rope dim 16 (powers of two >= 16), a byte-level BPE of 4096 ids whose top 256
ids are K2's special tokens at K2's offsets from the top of the vocabulary. Everything else (YaRN, sigmoid
noaux_tc routing with one group, a shared expert, routed scaling 2.827) is K2.6's own.

The drafter: 2 Qwen3 layers at the target's width, block 8, MASK = V - 2 (K2.6 DFlash's 163838 = V - 2),
target layers [1, 3, 5] chosen by hand (low, middle and last of 6, the spread K2.6's [1, 12, ..., 58] of 61 has).
"""

from __future__ import annotations

from typing import Any

from k26jax.config import MINI_TEXT_CONFIG, QUANT_CONFIG, DrafterConfig, ModelConfig

VOCAB = 4096
NUM_SPECIAL = 256

MINI_DRAFTER_LAYER_IDS = (1, 3, 5)
MASK_OFFSET = 2  # MASK id = V - 2, K2's [UNK] slot, which the byte-level BPE never produces


def text_config(overrides: dict | None = None) -> dict[str, Any]:
    """MINI_TEXT_CONFIG with `overrides` (smoke runs shrink it); special ids follow the vocabulary's top."""
    text = dict(MINI_TEXT_CONFIG, **(overrides or {}))
    V = text["vocab_size"]
    text.update(bos_token_id=V - NUM_SPECIAL, eos_token_id=V - NUM_SPECIAL + 1, pad_token_id=V - 1)
    return text


def model_config(text: dict[str, Any]) -> ModelConfig:
    return ModelConfig.from_hf_dict(dict(text, quantization_config=QUANT_CONFIG), source="k26-mini")


def drafter_config(
    text: dict[str, Any],
    *,
    num_layers: int = 2,
    layer_ids: tuple[int, ...] = MINI_DRAFTER_LAYER_IDS,
    intermediate_size: int = 768,
    heads: int = 8,
    block_size: int = 8,
) -> DrafterConfig:
    """The DFlash drafter for target `text`: Qwen3 layers at the target's width, the target's YaRN rope."""
    D = text["hidden_size"]
    return DrafterConfig.from_dict(
        {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": D,
            "intermediate_size": intermediate_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": D // heads,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": 1e-6,
            "rope_theta": text["rope_theta"],
            "rope_scaling": text["rope_scaling"],
            "max_position_embeddings": text["max_position_embeddings"],
            "num_target_layers": text["num_hidden_layers"],
            "block_size": block_size,
            "vocab_size": text["vocab_size"],
            "tie_word_embeddings": False,
            "dflash_config": {"mask_token_id": text["vocab_size"] - MASK_OFFSET, "target_layer_ids": list(layer_ids)},
        },
        source="k26-mini drafter",
    )
