"""Build small HF-format Kimi K2 / K2.6 checkpoints with random weights, plus reference outputs
from Hugging Face transformers' DeepseekV3ForCausalLM, for the CPU parity tests (no torch in CI).

Runs in its own Python 3.11 venv (torch FIRST: any other order pulls a multi-GB CUDA build):
    /root/.pyenv/versions/3.11.7/bin/python3 -m venv .fixture-venv
    .fixture-venv/bin/pip install torch==2.13.0
    .fixture-venv/bin/pip install transformers==5.24.0 compressed-tensors==0.20.1 safetensors numpy
    .fixture-venv/bin/python scripts/make_parity_fixtures.py            # writes tests/fixtures/

Writes, under tests/fixtures/:
    parity_k26/            K2.5/K2.6 on-disk layout: kimi_k25 wrapper, `language_model.` prefix, dummy
                           vision tensors, 3 shards, INT4 experts packed with compressed-tensors' pack_to_int32
    parity_k2_group/       plain K2 layout, group-limited routing (n_group 4, topk_group 2), q_lora_rank null
    parity_dsv3_norope/    config.json written by transformers' own save_pretrained (deepseek_v3,
                           rope_parameters, no rope scaling), single model.safetensors
    parity_<name>.npz      reference outputs of each checkpoint (see tests/fixtures/README.md)
    int4_pack.npz          compressed-tensors pack/unpack/dequantize reference

The reference model reads the checkpoint back from disk (index, shards, prefix) and dequantizes the
experts with compressed-tensors' own PackedQuantizationCompressor.decompress, so the logits depend on
the files, not on the arrays this script generated.
"""

import argparse
import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import torch
from compressed_tensors.compressors import PackedQuantizationCompressor, pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from compressed_tensors.quantization.lifecycle.forward import dequantize
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP, DeepseekV3MoE

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
INT4_GROUP = 32
QUANTIZATION_CONFIG = {  # as in the K2-Thinking / K2.5 config.json (compressed-tensors, routed experts only)
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": INT4_GROUP,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
SCHEME = QuantizationConfig.model_validate(QUANTIZATION_CONFIG).config_groups["group_0"]
# Input tokens are drawn so that every position is safe from bf16 noise (transformers' own bf16 run moves
# router scores by up to ~0.02 and logits by ~0.05 on these models): see choose_input_ids.
ROUTER_MIN_MARGIN = 0.03  # sigmoid(+bias) score units, for the k-th vs (k+1)-th expert and the group cut
LOGIT_MIN_MARGIN = 0.25
MAX_TOKEN_TRIES = 500


def k2_text_config(**overrides):
    """A K2-style text config.json dict (keys as in the raw Moonshot files), small dims."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "ep_size": 1,
        "first_k_dense_replace": 1,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 262144,
        "moe_layer_freq": 1,
        "n_group": 1,
        "n_routed_experts": 16,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_experts_per_tok": 4,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 64.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
        "routed_scaling_factor": 2.827,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
    }
    config.update(overrides)
    return config


@dataclasses.dataclass
class Fixture:
    name: str
    text_config: dict
    layout: str  # "k26" (wrapper + prefix + vision), "k2" (plain, sharded), "hf_saved" (save_pretrained, one file)
    seq_len: int
    seed: int
    shard_names: tuple = ()
    weight_shape_dtype: torch.dtype = torch.int64


FIXTURE_SPECS = [
    Fixture(
        name="parity_k26",
        text_config=k2_text_config(),
        layout="k26",
        seq_len=16,
        seed=26,
        shard_names=tuple(f"model-{i:05d}-of-{3:06d}.safetensors" for i in (1, 2, 3)),
        weight_shape_dtype=torch.int32,  # as in the published K2.5 files
    ),
    Fixture(
        name="parity_k2_group",
        text_config=k2_text_config(
            vocab_size=384,
            hidden_size=96,
            intermediate_size=160,
            moe_intermediate_size=32,
            num_hidden_layers=5,
            num_attention_heads=8,
            num_key_value_heads=8,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=24,
            n_routed_experts=32,
            num_experts_per_tok=6,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=2,
            rms_norm_eps=1e-6,
            max_position_embeddings=131072,
            rope_scaling={
                "beta_fast": 1.0,
                "beta_slow": 1.0,
                "factor": 32.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
                "type": "yarn",
            },
            quantization_config=QUANTIZATION_CONFIG,
        ),
        layout="k2",
        seq_len=13,
        seed=2,
        shard_names=("model-1-of-2.safetensors", "model-2-of-2.safetensors"),
    ),
    Fixture(
        name="parity_dsv3_norope",
        text_config=k2_text_config(
            model_type="deepseek_v3",
            vocab_size=256,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_shared_experts=1,
            n_group=4,
            topk_group=3,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            rope_scaling=None,
            max_position_embeddings=4096,
            quantization_config=QUANTIZATION_CONFIG,
        ),
        layout="hf_saved",
        seq_len=16,
        seed=3,
    ),
]


# ----------------------------------------------------------------------------- random weights


def bf16(array):
    return torch.from_numpy(np.asarray(array, np.float32)).to(torch.bfloat16)


def random_linear(rng, out_dim, in_dim, gain=1.0):
    """bf16 [out, in] with std gain/sqrt(in): keeps activations O(1) through the small model."""
    return bf16(rng.standard_normal((out_dim, in_dim)) * gain / math.sqrt(in_dim))


def random_norm(rng, dim):
    return bf16(1.0 + 0.1 * rng.standard_normal(dim))


def random_int4_expert(rng, out_dim, in_dim, gain=1.0):
    """INT4 values q [out, in] int8 in [-8, 7] (all 16 levels) and bf16 group-32 scales [out, in/32]."""
    q_int8 = torch.from_numpy(rng.integers(-8, 8, (out_dim, in_dim), dtype=np.int8))
    q_rms = math.sqrt(np.mean(np.arange(-8, 8) ** 2))
    scale = rng.uniform(0.5, 1.5, (out_dim, in_dim // INT4_GROUP)) * gain / (math.sqrt(in_dim) * q_rms)
    return q_int8, bf16(scale)


def random_text_weights(cfg, rng):
    """HF text tensors (names as in a plain K2 checkpoint) -> bf16/fp32 tensors, or (q_int8, scale) for experts."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, nope, rope, v_dim = (
        cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    experts, moe_inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    shared_inter = moe_inter * cfg["n_shared_experts"]
    weights = {"model.embed_tokens.weight": bf16(rng.standard_normal((vocab, hidden)))}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        weights[p + "input_layernorm.weight"] = random_norm(rng, hidden)
        if q_lora is None:
            weights[p + "self_attn.q_proj.weight"] = random_linear(rng, heads * (nope + rope), hidden)
        else:
            weights[p + "self_attn.q_a_proj.weight"] = random_linear(rng, q_lora, hidden)
            weights[p + "self_attn.q_a_layernorm.weight"] = random_norm(rng, q_lora)
            weights[p + "self_attn.q_b_proj.weight"] = random_linear(rng, heads * (nope + rope), q_lora)
        weights[p + "self_attn.kv_a_proj_with_mqa.weight"] = random_linear(rng, kv_lora + rope, hidden)
        weights[p + "self_attn.kv_a_layernorm.weight"] = random_norm(rng, kv_lora)
        weights[p + "self_attn.kv_b_proj.weight"] = random_linear(rng, heads * (nope + v_dim), kv_lora)
        weights[p + "self_attn.o_proj.weight"] = random_linear(rng, hidden, heads * v_dim)
        weights[p + "post_attention_layernorm.weight"] = random_norm(rng, hidden)
        if layer < cfg["first_k_dense_replace"]:
            inter = cfg["intermediate_size"]
            weights[p + "mlp.gate_proj.weight"] = random_linear(rng, inter, hidden)
            weights[p + "mlp.up_proj.weight"] = random_linear(rng, inter, hidden)
            weights[p + "mlp.down_proj.weight"] = random_linear(rng, hidden, inter)
            continue
        weights[p + "mlp.gate.weight"] = random_linear(rng, experts, hidden, gain=2.0)
        bias = 0.15 * rng.standard_normal(experts)  # fp32 on disk; big enough to change selections
        weights[p + "mlp.gate.e_score_correction_bias"] = torch.from_numpy(bias.astype(np.float32))
        weights[p + "mlp.shared_experts.gate_proj.weight"] = random_linear(rng, shared_inter, hidden)
        weights[p + "mlp.shared_experts.up_proj.weight"] = random_linear(rng, shared_inter, hidden)
        weights[p + "mlp.shared_experts.down_proj.weight"] = random_linear(rng, hidden, shared_inter)
        for e in range(experts):
            weights[p + f"mlp.experts.{e}.gate_proj"] = random_int4_expert(rng, moe_inter, hidden)
            weights[p + f"mlp.experts.{e}.up_proj"] = random_int4_expert(rng, moe_inter, hidden)
            weights[p + f"mlp.experts.{e}.down_proj"] = random_int4_expert(rng, hidden, moe_inter)
    weights["model.norm.weight"] = random_norm(rng, hidden)
    weights["lm_head.weight"] = random_linear(rng, vocab, hidden, gain=4.0)
    return weights


def compress_expert(q_int8, scale, weight_shape_dtype):
    """Expert projection -> {weight_packed [out, in/8] int32, weight_scale [out, in/32] bf16, weight_shape [2]}.

    int64 weight_shape: compressed-tensors' own compressor (quantize + pack_to_int32) from the bf16 weight.
    int32 weight_shape (the published K2.5 files): pack_to_int32 on the int values directly.
    Both paths give the same packed words (asserted)."""
    packed = pack_to_int32(q_int8, num_bits=4)
    if weight_shape_dtype == torch.int32:
        shape = torch.tensor(q_int8.shape, dtype=torch.int32)
        return {"weight_packed": packed, "weight_scale": scale, "weight_shape": shape}
    weight = dequantize(q_int8, scale, args=SCHEME.weights)  # bf16(q * scale)
    out = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale}, SCHEME)
    assert torch.equal(out["weight_packed"], packed), "compressor and pack_to_int32 disagree"
    assert out["weight_shape"].dtype == torch.int64 and set(out) == {"weight_packed", "weight_scale", "weight_shape"}
    return dict(out)


def flat_tensors(weights, weight_shape_dtype, prefix=""):
    """Expand expert (q, scale) pairs into their three on-disk tensors, add the name prefix."""
    tensors = {}
    for name, value in weights.items():
        if isinstance(value, tuple):
            for suffix, tensor in compress_expert(*value, weight_shape_dtype).items():
                tensors[f"{prefix}{name}.{suffix}"] = tensor
        else:
            tensors[prefix + name] = value
    return tensors


# ----------------------------------------------------------------------------- on-disk layouts


def dummy_vision_tensors(rng):
    """A few bf16 tensors under the K2.5 vision names; loaders must skip them."""
    shapes = {
        "vision_tower.patch_embed.proj.weight": (32, 3, 14, 14),
        "vision_tower.encoder.blocks.0.wqkv.weight": (96, 32),
        "vision_tower.encoder.blocks.0.wo.weight": (32, 32),
        "vision_tower.encoder.final_layernorm.weight": (32,),
        "mm_projector.pre_norm.weight": (32,),
        "mm_projector.proj.0.weight": (128, 128),
        "mm_projector.proj.2.weight": (128, 128),
    }
    return {name: bf16(0.02 * rng.standard_normal(shape)) for name, shape in shapes.items()}


def k26_shard_of(name, cfg):
    """Shard index for the K2.6 layout: three shards, one expert's projections split across all three
    (gate_proj in 1, up_proj + down_proj.weight_packed in 2, down_proj.weight_scale/shape in 3)."""
    if name.startswith("vision_tower."):
        return 0
    if name.startswith(("mm_projector.", "language_model.lm_head.", "language_model.model.norm.")):
        return 2
    match = re.match(r"language_model\.model\.layers\.(\d+)\.(.*)", name)
    if not match:
        return 0  # embed_tokens
    layer, rest = int(match[1]), match[2]
    first_moe, last = cfg["first_k_dense_replace"], cfg["num_hidden_layers"] - 1
    split_expert = cfg["n_routed_experts"] // 2
    if layer < first_moe:
        return 0
    if layer == first_moe:
        expert = re.match(r"mlp\.experts\.(\d+)\.(\w+)\.(\w+)", rest)
        if not expert or int(expert[1]) < split_expert:
            return 0
        if int(expert[1]) > split_expert:
            return 1
        proj, tensor = expert[2], expert[3]
        if proj == "gate_proj":
            return 0
        return 2 if proj == "down_proj" and tensor != "weight_packed" else 1
    return 2 if layer == last else 1


def write_shards(out_dir, tensors, shard_names, shard_of):
    """Write tensors into named shards and model.safetensors.index.json; return {shard name: [tensor names]}."""
    contents = {name: {} for name in shard_names}
    for name, tensor in tensors.items():
        contents[shard_names[shard_of(name)]][name] = tensor
    for shard, shard_tensors in contents.items():
        assert shard_tensors, f"empty shard {shard}"
        save_file(shard_tensors, out_dir / shard, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": {name: shard for shard, names in contents.items() for name in sorted(names)},
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return {shard: sorted(names) for shard, names in contents.items()}


def split_experts(layout):
    """{(layer, expert): sorted shards} for every routed expert whose tensors sit in more than one shard."""
    shards_of = {}
    for shard, names in layout.items():
        for name in names:
            if match := re.search(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.", name):
                shards_of.setdefault((int(match[1]), int(match[2])), set()).add(shard)
    return {key: sorted(shards) for key, shards in shards_of.items() if len(shards) > 1}


def by_size_shard_of(tensors, n_shards):
    """Contiguous split of the tensors (in insertion order) into n_shards of about equal bytes."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assignment, running = {}, 0
    for name, tensor in tensors.items():
        assignment[name] = min(n_shards - 1, running * n_shards // total)
        running += tensor.numel() * tensor.element_size()
    return assignment.__getitem__


def write_checkpoint(fixture, out_dir, rng):
    """Write config.json + safetensors for one fixture; return {shard: [names]}."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("*"):
        stale.unlink()
    cfg = fixture.text_config
    weights = random_text_weights(cfg, rng)
    if fixture.layout == "k26":
        wrapper = {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "auto_map": {
                "AutoConfig": "configuration_kimi_k25.KimiK25Config",
                "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
                "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            },
            "model_type": "kimi_k25",
            "bos_token_id": cfg["bos_token_id"],
            "eos_token_id": cfg["eos_token_id"],
            "pad_token_id": cfg["pad_token_id"],
            "media_placeholder_token_id": 163605,
            "use_unified_vision_chunk": True,
            "video_placeholder": "<|kimi_k25_video_placeholder|>",
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "quantization_config": QUANTIZATION_CONFIG,
            "text_config": cfg,
            "vision_config": {
                "patch_size": 14,
                "init_pos_emb_height": 64,
                "init_pos_emb_width": 64,
                "init_pos_emb_time": 4,
                "pos_emb_type": "divided_fixed",
                "vt_num_attention_heads": 2,
                "vt_num_hidden_layers": 1,
                "vt_hidden_size": 32,
                "vt_intermediate_size": 64,
                "merge_kernel_size": [2, 2],
                "merge_type": "sd2_tpool",
                "mm_projector_type": "patchmerger",
                "mm_hidden_size": 32,
                "projector_hidden_act": "gelu",
                "projector_ln_eps": 1e-5,
                "text_hidden_size": cfg["hidden_size"],
            },
        }
        (out_dir / "config.json").write_text(json.dumps(wrapper, indent=2) + "\n")
        text_tensors = flat_tensors(weights, fixture.weight_shape_dtype, prefix="language_model.")
        tensors = dummy_vision_tensors(rng) | text_tensors
        layout = write_shards(out_dir, tensors, fixture.shard_names, lambda name: k26_shard_of(name, cfg))
        assert max(len(shards) for shards in split_experts(layout).values()) == 3
        return layout
    tensors = flat_tensors(weights, fixture.weight_shape_dtype)
    if fixture.layout == "k2":
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        return write_shards(out_dir, tensors, fixture.shard_names, by_size_shard_of(tensors, len(fixture.shard_names)))
    assert fixture.layout == "hf_saved"
    DeepseekV3Config.from_dict(cfg).save_pretrained(out_dir)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    return {"model.safetensors": sorted(tensors)}


# ----------------------------------------------------------------------------- reference model


def read_checkpoint(ckpt_dir):
    """All tensors of a HF dir: through model.safetensors.index.json when present, else model.safetensors."""
    index_path = ckpt_dir / "model.safetensors.index.json"
    if not index_path.exists():
        return load_file(ckpt_dir / "model.safetensors")
    weight_map = json.loads(index_path.read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        shard_tensors = load_file(ckpt_dir / shard)
        assert all(weight_map[name] == shard for name in shard_tensors), f"index disagrees with {shard}"
        tensors |= shard_tensors
    assert set(tensors) == set(weight_map)
    return tensors


def hf_text_config(ckpt_dir):
    """The DeepseekV3Config transformers builds from the dir's config.json (wrapper -> text_config)."""
    raw = json.loads((ckpt_dir / "config.json").read_text())
    if raw["model_type"] == "kimi_k25":
        config = AutoConfig.from_pretrained(ckpt_dir).text_config
        assert isinstance(config, DeepseekV3Config)
        return config, raw["quantization_config"]
    if raw["model_type"] == "kimi_k2":  # not registered in transformers; the remote code maps it to DeepseekV3
        return DeepseekV3Config.from_pretrained(ckpt_dir), raw["quantization_config"]
    return AutoConfig.from_pretrained(ckpt_dir), raw["quantization_config"]


def hf_state_dict(tensors, config, quantization_config):
    """Checkpoint tensors -> DeepseekV3ForCausalLM float32 state dict (experts fused as transformers 5.x holds them)."""
    scheme = QuantizationConfig.model_validate(quantization_config).config_groups["group_0"]
    state, experts = {}, {}
    for name, tensor in tensors.items():
        if name.startswith(("vision_tower.", "mm_projector.")):
            continue
        name = name.removeprefix("language_model.")
        match = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+_proj)\.(weight_\w+)", name)
        if match:
            experts.setdefault((match[1], int(match[2]), match[3]), {})[match[4]] = tensor
        else:
            state[name] = tensor.float()
    dense = {key: PackedQuantizationCompressor.decompress(parts, scheme)["weight"] for key, parts in experts.items()}
    for prefix in sorted({key[0] for key in dense}):
        n = config.n_routed_experts
        state[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([dense[prefix, e, "gate_proj"], dense[prefix, e, "up_proj"]]) for e in range(n)]
        ).float()
        state[prefix + ".down_proj"] = torch.stack([dense[prefix, e, "down_proj"] for e in range(n)]).float()
    assert all(w.dtype == torch.bfloat16 for w in dense.values())
    return state


def yarn_inv_freq_and_scale(config):
    """Independent float64 YaRN (k26_architecture.md §2.4, §2.6): inv_freq [rope/2] and the softmax scale."""
    dim, qk_dim = config.qk_rope_head_dim, config.qk_nope_head_dim + config.qk_rope_head_dim
    rope = config.rope_parameters
    base_freq = rope["rope_theta"] ** (-np.arange(0, dim, 2) / dim)
    if rope["rope_type"] == "default":
        return base_freq, qk_dim**-0.5
    factor, orig = rope["factor"], rope["original_max_position_embeddings"]

    def correction_dim(rotations):
        return dim * math.log(orig / (2 * math.pi * rotations)) / (2 * math.log(rope["rope_theta"]))

    low = max(math.floor(correction_dim(rope["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(rope["beta_slow"])), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    inv_freq = base_freq / factor * ramp + base_freq * (1 - ramp)
    mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0
    return inv_freq, qk_dim**-0.5 * mscale**2


def check_model_uses_config(model, text_cfg):
    """Assert that the instantiated transformers model really uses the values of our config.json."""
    config = model.config
    assert config._attn_implementation == "eager" and config._experts_implementation == "eager"
    assert config.rope_interleave is True
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "n_routed_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "first_k_dense_replace",
        "norm_topk_prob",
        "routed_scaling_factor",
        "rms_norm_eps",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_shared_experts",
    ):
        assert getattr(config, key) == text_cfg[key], key
    # fields the modeling code never reads: only the values it hard-codes are allowed
    assert text_cfg["scoring_func"] == "sigmoid" and text_cfg["topk_method"] == "noaux_tc"
    assert text_cfg["moe_layer_freq"] == 1 and text_cfg["hidden_act"] == "silu"
    inv_freq, scale = yarn_inv_freq_and_scale(config)
    np.testing.assert_allclose(model.model.rotary_emb.inv_freq.numpy(), inv_freq, rtol=1e-6)
    assert model.model.rotary_emb.attention_scaling == 1.0  # mscale == mscale_all_dim (or no scaling)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        assert math.isclose(attn.scaling, scale, rel_tol=1e-12), (attn.scaling, scale)
        assert (attn.q_proj is not None) == (text_cfg["q_lora_rank"] is None)
        if attn.q_a_layernorm is not None:
            assert attn.q_a_layernorm.variance_epsilon == 1e-6
        assert attn.kv_a_layernorm.variance_epsilon == 1e-6
        assert layer.input_layernorm.variance_epsilon == text_cfg["rms_norm_eps"]
        moe = i >= text_cfg["first_k_dense_replace"]
        assert isinstance(layer.mlp, DeepseekV3MoE if moe else DeepseekV3MLP)
        if moe:
            gate = layer.mlp.gate
            assert (gate.num_group, gate.topk_group, gate.top_k) == (
                text_cfg["n_group"],
                text_cfg["topk_group"],
                text_cfg["num_experts_per_tok"],
            )
            assert gate.norm_topk_prob == text_cfg["norm_topk_prob"]
            assert gate.routed_scaling_factor == text_cfg["routed_scaling_factor"]
            shared_inter = text_cfg["moe_intermediate_size"] * text_cfg["n_shared_experts"]
            assert layer.mlp.shared_experts.intermediate_size == shared_inter
    assert model.model.norm.variance_epsilon == text_cfg["rms_norm_eps"]
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert len(model.model.layers) == text_cfg["num_hidden_layers"]


def route(router_logits, bias, n_group, topk_group, top_k):
    """float64 selection as in the reference router: returns (sorted ids [N, k], selection margin, group margin)."""
    scores = 1.0 / (1.0 + np.exp(-router_logits)) + bias
    tokens, experts = scores.shape
    grouped = scores.reshape(tokens, n_group, experts // n_group)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)  # [N, n_group]: sum of each group's top 2
    group_order = np.argsort(-group_scores, axis=-1)
    ranked_groups = np.take_along_axis(group_scores, group_order, axis=-1)
    rows = np.arange(tokens)[:, None]
    masked = np.full_like(grouped, -np.inf)
    masked[rows, group_order[:, :topk_group]] = grouped[rows, group_order[:, :topk_group]]
    masked = masked.reshape(tokens, experts)
    order = np.argsort(-masked, axis=-1)
    ids = np.sort(order[:, :top_k], axis=-1)
    ranked = np.take_along_axis(masked, order, axis=-1)
    selection_margin = ranked[:, top_k - 1] - ranked[:, top_k] if top_k < experts else np.inf
    group_margin = ranked_groups[:, topk_group - 1] - ranked_groups[:, topk_group] if topk_group < n_group else np.inf
    return ids, np.min(selection_margin), np.min(group_margin)


def load_reference_model(ckpt_dir, text_cfg):
    """DeepseekV3ForCausalLM (float32, eager attention, eager experts) on the checkpoint read back from disk."""
    config, quantization_config = hf_text_config(ckpt_dir)
    model = DeepseekV3ForCausalLM._from_config(
        config, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    ).eval()
    model.load_state_dict(hf_state_dict(read_checkpoint(ckpt_dir), config, quantization_config), strict=True)
    check_model_uses_config(model, text_cfg)
    return model


class RouterRecorder:
    """Forward hooks on every MoE router; `outputs[layer]` = (router_logits [N, E], topk_weights, topk_ids)."""

    def __init__(self, model):
        self.outputs = {}
        layers = enumerate(model.model.layers)
        self.gates = {i: layer.mlp.gate for i, layer in layers if isinstance(layer.mlp, DeepseekV3MoE)}
        self.hooks = [gate.register_forward_hook(self._keep(i)) for i, gate in self.gates.items()]

    def _keep(self, layer):
        return lambda module, args, output: self.outputs.__setitem__(layer, output)

    def route(self, layer, rows=slice(None), use_bias=True, use_groups=True):
        gate = self.gates[layer]
        bias = gate.e_score_correction_bias.double().numpy() * use_bias
        groups = (gate.num_group, gate.topk_group) if use_groups else (1, 1)
        return route(self.outputs[layer][0][rows].double().numpy(), bias, *groups, gate.top_k)


def choose_input_ids(model, recorder, vocab, seq_len, rng):
    """Two random sequences [2, T], drawn token by token: a candidate for position t is kept only if, at t,
    the float32 logit top-1/top-2 margin and every router selection/group margin are safe. The model is
    causal, so later tokens never change earlier positions."""
    sequences = []
    for _ in range(2):
        ids = []
        for _ in range(seq_len):
            for _ in range(MAX_TOKEN_TRIES):
                candidate = ids + [int(rng.integers(vocab))]
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([candidate]), use_cache=False).logits[0, -1].numpy()
                top2 = np.sort(logits)[-2:]
                router_margin = min(min(recorder.route(layer, rows=slice(-1, None))[1:]) for layer in recorder.gates)
                if top2[1] - top2[0] > LOGIT_MIN_MARGIN and router_margin > ROUTER_MIN_MARGIN:
                    ids = candidate
                    break
            else:
                raise RuntimeError(f"no safe token at position {len(ids)} after {MAX_TOKEN_TRIES} tries")
        sequences.append(ids)
    assert sequences[0] != sequences[1]
    return torch.tensor(sequences)


def reference_outputs(fixture, ckpt_dir, rng):
    """Reference arrays for one checkpoint (see tests/fixtures/README.md) and a dict of statistics."""
    cfg = fixture.text_config
    model = load_reference_model(ckpt_dir, cfg)
    recorder = RouterRecorder(model)
    input_ids = choose_input_ids(model, recorder, cfg["vocab_size"], fixture.seq_len, rng)
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(lambda module, args, out: captured.__setitem__("last", out))
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    hook.remove()

    logits = out.logits.numpy()
    hidden_states = torch.stack(out.hidden_states).numpy()
    with torch.no_grad():
        np.testing.assert_array_equal(hidden_states[0], model.model.embed_tokens(input_ids).numpy())
        np.testing.assert_array_equal(hidden_states[-1], model.model.norm(captured["last"]).numpy())
    top2 = np.sort(logits, axis=-1)[..., -2:]
    arrays = {
        "input_ids": input_ids.numpy().astype(np.int32),
        "logits": logits,
        "hidden_states": hidden_states,
        "last_layer_output": captured["last"].numpy(),
        "logit_margin": top2[..., 1] - top2[..., 0],
    }
    stats = {"min_logit_margin": round(float(arrays["logit_margin"].min()), 4)}
    shape = (2, fixture.seq_len)
    for layer in recorder.gates:
        router_logits, topk_weights, topk_ids = recorder.outputs[layer]
        ids, selection_margin, group_margin = recorder.route(layer)
        order = torch.argsort(topk_ids, dim=-1)
        hf_ids = torch.gather(topk_ids, -1, order).numpy()
        assert np.array_equal(ids, hf_ids), f"layer {layer}: float64 routing disagrees with transformers"
        assert min(selection_margin, group_margin) > ROUTER_MIN_MARGIN / 2, (layer, selection_margin, group_margin)
        changed_by_bias = int(np.any(recorder.route(layer, use_bias=False)[0] != ids, axis=-1).sum())
        changed_by_groups = int(np.any(recorder.route(layer, use_groups=False)[0] != ids, axis=-1).sum())
        assert changed_by_bias > 0, f"layer {layer}: the correction bias never changes the selection"
        assert changed_by_groups > 0 or recorder.gates[layer].num_group == 1, f"layer {layer}: groups never matter"
        arrays[f"router_logits_layer{layer}"] = router_logits.numpy().reshape(*shape, -1)
        arrays[f"topk_ids_layer{layer}"] = hf_ids.astype(np.int32).reshape(*shape, -1)
        arrays[f"topk_weights_layer{layer}"] = torch.gather(topk_weights, -1, order).numpy().reshape(*shape, -1)
        stats[f"layer{layer}"] = {
            "tokens_changed_by_bias": changed_by_bias,
            "tokens_changed_by_groups": changed_by_groups,
            "min_selection_margin": round(float(selection_margin), 4),
            "min_group_margin": round(float(group_margin), 4),
        }
    stats["hf_bf16_vs_f32"] = bf16_agreement(model, recorder, input_ids, arrays)
    return arrays, stats


def bf16_agreement(model, recorder, input_ids, arrays):
    """transformers' own bf16 run against its float32 arrays: a yardstick for the bf16 parity tests."""
    model.to(torch.bfloat16)
    with torch.no_grad():
        logits_bf16 = model(input_ids=input_ids, use_cache=False).logits.float().numpy()
    model.float()
    flips = sum(
        int(
            (
                recorder.outputs[layer][2].sort(-1).values.numpy().reshape(arrays[f"topk_ids_layer{layer}"].shape)
                != arrays[f"topk_ids_layer{layer}"]
            )
            .any(-1)
            .sum()
        )
        for layer in recorder.gates
    )
    ref = arrays["logits"]
    return {
        "logits_rel_err": round(float(np.linalg.norm(logits_bf16 - ref) / np.linalg.norm(ref)), 4),
        "argmax_mismatches": int((logits_bf16.argmax(-1) != ref.argmax(-1)).sum()),
        "routing_flips": flips,
    }


# ----------------------------------------------------------------------------- INT4 packing fixture


def int4_pack_fixture(path, rng):
    q_int8 = rng.integers(-8, 8, (64, 96), dtype=np.int8)
    q_int8[0, :8] = [1, -1, 0, 7, -7, 2, -2, 3]  # the worked example of k26_architecture.md §4
    q_int8[1, 0], q_int8[1, 1] = -8, 7
    q = torch.from_numpy(q_int8)
    packed = pack_to_int32(q, num_bits=4)
    assert packed[0, 0].item() == -1230899079  # 0xB6A1F879 as signed int32
    unpacked = unpack_from_int32(packed, 4, q.shape)
    assert torch.equal(unpacked, q)
    scale = bf16(rng.uniform(0.002, 0.05, (64, 96 // INT4_GROUP)))
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=INT4_GROUP)
    dequantized = dequantize(unpacked, scale, args=args)
    assert dequantized.dtype == torch.bfloat16
    np.savez(
        path,
        q_int=q_int8,
        packed=packed.numpy(),
        unpacked=unpacked.numpy(),
        scale=scale.float().numpy(),
        dequantized=dequantized.float().numpy(),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=FIXTURES)
    args = parser.parse_args()
    torch.manual_seed(0)
    int4_pack_fixture(args.out / "int4_pack.npz", np.random.default_rng(4))
    for fixture in FIXTURE_SPECS:
        rng = np.random.default_rng(fixture.seed)
        layout = write_checkpoint(fixture, args.out / fixture.name, rng)
        arrays, stats = reference_outputs(fixture, args.out / fixture.name, rng)
        np.savez(args.out / f"{fixture.name}.npz", **arrays)
        print(f"== {fixture.name}")
        for shard, names in layout.items():
            layers = sorted({int(m[1]) for n in names if (m := re.search(r"layers\.(\d+)\.", n))})
            print(f"   {shard}: {len(names)} tensors, layers {layers}")
        print(f"   experts split across shards: {split_experts(layout)}")
        print("   " + json.dumps(stats))


if __name__ == "__main__":
    main()
