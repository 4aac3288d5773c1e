"""Write a random-weight HF checkpoint in the exact K2.6 on-disk format.

    python -m convert.make_tiny --out DIR [--preset tiny|k26-depthN] [--experts N] [--seed S]

What it writes (the layout of moonshotai/Kimi-K2.6, at the preset's dims):
  config.json                  `kimi_k25` wrapper: `text_config` (kimi_k2, with the compressed-tensors
                               quantization_config), a small `vision_config`, the media placeholder id
  generation_config.json       bos / eos (<|im_end|>) / pad
  model-0000i-of-00000n.safetensors + model.safetensors.index.json
                               several shards (`language_model.` prefix, dummy `vision_tower.*` / `mm_projector.*`
                               tensors); the first MoE layer's expert 0 is split across two shards
                               routed experts INT4: weight_packed int32 [out, in/8], weight_scale bf16 [out, in/32],
                               weight_shape int32 [2]; everything else bf16, e_score_correction_bias fp32
  tiktoken.model, tokenizer_config.json
                               a byte-level BPE filling ids [0, V-256) and K2's 256 special tokens at K2's offsets
                               from the top of the vocabulary, with the K2 chat template
  drafter/                     a matching DFlash drafter (tiny preset only; `--no-drafter` to skip)

Weights are deterministic in --seed; lm_head/embed std 4/sqrt(D) so greedy logits are far from ties.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from collections import Counter

import numpy as np

from k26jax import hf, hf_files
from k26jax.config import ConfigError, DrafterConfig, ModelConfig, preset_text_config
from k26jax.hf import NUM_SPECIAL, special_tokens
from k26jax.model import drafter
from k26jax.model.params import GROUP

BPE_CORPUS = """\
The quick brown fox jumps over the lazy dog. Kimi is a large language model with a mixture of experts:
every token is routed to eight of three hundred and eighty four experts, and a shared expert sees every token.
Attention compresses the keys and values into a small latent vector, so the cache stays small on long
contexts. A drafter proposes a tree of tokens; the target model verifies the whole tree in one step and
accepts the longest path that matches its own choice. Hello, world! How are you today? I am fine, thank you.
What is the capital of France? The capital of France is Paris. Please write a short poem about the sea,
the sky, the stars and the wind. Once upon a time there was a little program that wanted to run very fast
on many devices at once. It learned to split its weights across eight machines and to read only what it
needed from the disk. def main(): return sum(range(10)) if __name__ == "__main__": print(main())
Numbers like 1, 2, 3, 42, 100 and 2026 appear in text; so do dates, names, places and questions.
system user assistant tool think answer reasoning content message role function arguments result
Good morning! Could you explain, step by step, why the sky looks blue during the day but red at sunset?
Sunlight scatters off small molecules in the air; shorter wavelengths scatter more strongly than longer ones.
Write a function that sorts a list of integers, then test it with several inputs including an empty list.
"""


def bpe_ranks(num_tokens: int, corpus: str = BPE_CORPUS) -> dict[bytes, int]:
    """Byte-level BPE: 256 byte tokens, then the most frequent adjacent pairs of `corpus` (ties by bytes), then,
    once the corpus is fully merged, concatenations of two earlier tokens in rank order (valid BPE merges)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(tuple(bytes([c]) for c in w.encode()) for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", corpus))
    while len(ranks) < num_tokens:
        pairs: Counter = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        a, b = max(pairs, key=lambda p: (pairs[p], p))
        ranks.setdefault(a + b, len(ranks))
        words = Counter({_merge(w, a, b): c for w, c in words.items()})
    learned = [t for t, _ in sorted(ranks.items(), key=lambda kv: kv[1])][::-1]  # longest merges first
    for a in learned:
        for b in learned:
            if len(ranks) >= num_tokens:
                return ranks
            ranks.setdefault(a + b, len(ranks))
    return ranks


def _merge(word: tuple, a: bytes, b: bytes) -> tuple:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def write_tokenizer(out: str, vocab_size: int) -> None:
    hf.write_tokenizer(out, bpe_ranks(vocab_size - NUM_SPECIAL), special_tokens(vocab_size))


# ---- weights ------------------------------------------------------------------------------------------------
class _Weights:
    """Deterministic random tensors, generated one at a time in checkpoint order."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def normal(self, shape, std, mean=0.0, dtype=hf.BF16):
        out = np.empty(shape, dtype)
        flat, rows = out.reshape(-1, shape[-1]), max(1, (1 << 24) // shape[-1])
        for start in range(0, flat.shape[0], rows):
            block = self.rng.standard_normal((min(rows, flat.shape[0] - start), shape[-1]), np.float32)
            flat[start : start + rows] = block * np.float32(std) + np.float32(mean)
        return out

    def int4_linear(self, out_dim, in_dim):
        """(packed, scale, shape): uniform q in [-8, 7], scales so the weight std is about 1/sqrt(in)."""
        q = self.rng.integers(-8, 8, (out_dim, in_dim), np.int8)
        scale = (self.rng.uniform(0.5, 1.5, (out_dim, in_dim // GROUP)) / (4.6 * in_dim**0.5)).astype(hf.BF16)
        return hf.pack_int4(q), scale, np.array([out_dim, in_dim], np.int32)


def _text_tensors(w: _Weights, cfg: ModelConfig):
    """Yields (name without the `language_model.` prefix, array) for the text model's tensors (k26jax.hf's
    target_modules, in checkpoint order): routed experts INT4; embedding and lm_head std 4/sqrt(D), other linears
    1/sqrt(in); norm weights 1 + N(0, 0.1^2); the fp32 router bias N(0, 0.1^2)."""
    D = cfg.hidden_size
    for m in hf.target_modules(cfg):
        if m.kind == "int4":
            packed, scale, shape = w.int4_linear(*m.shape)
            yield m.name + ".weight_packed", packed
            yield m.name + ".weight_scale", scale
            yield m.name + ".weight_shape", shape
        elif len(m.shape) == 2:
            std = 4 * D**-0.5 if m.layer is None else m.shape[1] ** -0.5
            yield m.name + (".weight" if m.kind == "linear" else ""), w.normal(m.shape, std)
        elif m.dtype == "float32":
            yield m.name, w.normal(m.shape, 0.1, dtype=np.float32)
        else:
            yield m.name, w.normal(m.shape, 0.1, 1.0)


def _vision_tensors(w: _Weights, text_hidden: int):
    """A few bf16 tensors under K2.5's vision names (loaders skip them)."""
    for name, shape in hf.vision_tensor_shapes(text_hidden):
        yield name, w.normal(shape, 0.02)


def _all_tensors(w: _Weights, cfg: ModelConfig):
    for name, arr in _text_tensors(w, cfg):
        yield hf.WRAPPER_PREFIX + name, arr
    yield from _vision_tensors(w, cfg.hidden_size)


def write_weights(out: str, cfg: ModelConfig, seed: int, shard_bytes: int) -> list[str]:
    """Writes the shards and the index, holding one shard in memory; returns the shard file names. The first MoE
    layer's expert 0 straddles two shards."""
    first_moe = cfg.layer_kinds.index("moe") if "moe" in cfg.layer_kinds else None
    split_after = (
        f"{hf.WRAPPER_PREFIX}model.layers.{first_moe}.mlp.experts.0.up_proj.weight_shape"
        if first_moe is not None
        else None
    )
    return hf_files.write_shards(out, _all_tensors(_Weights(seed), cfg), shard_bytes, split_after)


# ---- configs ------------------------------------------------------------------------------------------------
def hf_config(text: dict) -> dict:
    """The kimi_k25 wrapper config.json around a text config dict."""
    return hf.wrapper_config(text)


def tiny_text_config(preset: str, experts: int | None = None, overrides: dict | None = None) -> dict:
    """The preset's text config dict with `overrides` applied (`experts`: n_routed_experts); special ids at
    K2's offsets from the top of the vocabulary."""
    text = dict(preset_text_config(preset), **(overrides or {}))
    if experts is not None:
        text["n_routed_experts"] = experts
    V = text["vocab_size"]
    text.update(bos_token_id=V - 256, eos_token_id=V - 255, pad_token_id=V - 1)
    return text


def make_tiny(
    out: str,
    preset: str = "tiny",
    *,
    experts: int | None = None,
    seed: int = 0,
    drafter: bool | None = None,
    shard_bytes: int | None = None,
    overrides: dict | None = None,
) -> ModelConfig:
    """Writes the checkpoint (see the module docstring) into the new or empty directory `out`.

    drafter: None writes one for the tiny preset only. overrides: text-config fields to change (tests). The files
    are written into a hidden sibling directory that becomes `out` only when complete (removed on failure)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"--out {out}: exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out):
        raise FileExistsError(f"--out {out}: directory exists and is not empty")
    text = tiny_text_config(preset, experts, overrides)
    ModelConfig.from_hf_dict(hf_config(text), source=f"--preset {preset}")  # fails before anything is written
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out))}.", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(work, 0o777 & ~umask)  # mkdtemp's is 0o700
    try:
        cfg = _write(work, text, preset, seed, drafter, shard_bytes)
        os.rename(work, out)  # onto a missing or empty directory
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # this call's own directory
        raise
    return cfg


def _write(out: str, text: dict, preset: str, seed: int, drafter: bool | None, shard_bytes: int | None):
    config = hf_config(text)
    hf_files.dump_json(os.path.join(out, "config.json"), config)
    V = text["vocab_size"]
    hf_files.dump_json(
        os.path.join(out, "generation_config.json"),
        {"bos_token_id": V - 256, "eos_token_id": V - 254, "pad_token_id": V - 1, "do_sample": False},
    )
    cfg = ModelConfig.from_hf_dir(out)
    write_weights(out, cfg, seed, shard_bytes or (2_500_000 if preset == "tiny" else 2 << 30))
    write_tokenizer(out, V)
    if drafter if drafter is not None else preset == "tiny":
        write_drafter(os.path.join(out, "drafter"), text, seed + 1)
    return cfg


def write_drafter(out: str, target_text: dict, seed: int) -> None:
    """A DFlash drafter for the target: hidden = target hidden, 2 layers, block 8, target layers [1, 2], mask V-2."""
    V = target_text["vocab_size"]
    dcfg = DrafterConfig.from_dict(
        {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": target_text["hidden_size"],
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "head_dim": 32,
            "hidden_act": "silu",
            "attention_bias": False,
            "rms_norm_eps": 1e-6,
            "rope_theta": target_text["rope_theta"],
            "rope_scaling": target_text["rope_scaling"],
            "max_position_embeddings": target_text["max_position_embeddings"],
            "num_target_layers": target_text["num_hidden_layers"],
            "block_size": 8,
            "vocab_size": V,
            "tie_word_embeddings": False,
            "dflash_config": {"mask_token_id": V - 2, "target_layer_ids": [1, 2]},
        }
    )
    hf.write_drafter(out, dcfg, drafter.init_params(dcfg, seed), dtype="bfloat16")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m convert.make_tiny", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="new (or empty) output directory")
    parser.add_argument("--preset", default="tiny", help="tiny | k26-depthN (full width, N layers)")
    parser.add_argument("--experts", type=int, help="override n_routed_experts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-drafter", action="store_true", help="skip DIR/drafter/")
    args = parser.parse_args(argv)
    try:
        cfg = make_tiny(
            args.out, args.preset, experts=args.experts, seed=args.seed, drafter=False if args.no_drafter else None
        )
    except (ConfigError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: nothing was written", file=sys.stderr)
        return 130
    print(f"wrote {args.out}: {args.preset}, {cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
