"""Reference fixtures for the DFlash drafter, from z-lab's `dflash==0.1.0` `DFlashDraftModel` (torch).

Runs in the Python 3.11 fixture venv, never in CI:
    python3.11 -m venv /tmp/dflash-venv
    /tmp/dflash-venv/bin/pip install torch==2.13.0            # first: the CPU build
    /tmp/dflash-venv/bin/pip install transformers==5.24.0 safetensors numpy
    /tmp/dflash-venv/bin/pip install --no-deps dflash==0.1.0
    /tmp/dflash-venv/bin/python scripts/make_dflash_fixtures.py

Writes to tests/fixtures/dflash/:
    drafter/config.json, drafter/model.safetensors   the drafter in z-lab's layout (save_pretrained, bf16)
    reference.npz    target embed/lm_head, context features, block ids, the reference's per-layer hidden
                     states and draft logits (float32), and rope tables for several rope configs
    provenance.json  package versions and the fixture's shapes
The float32 reference runs with the bf16-rounded weights, so the bf16 file on disk holds them exactly.
"""

import argparse
import json
import os
from importlib.metadata import version

import numpy as np
import torch
from dflash.model import DFlashDraftModel, _crop_to, _output_head, _raw_input_embeddings, extract_context_feature
from torch import nn
from transformers import DynamicCache, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

BATCH, CTX_LEN, SHORT_CTX_LEN, SPLIT = 2, 10, 6, 6
NUM_TARGET_LAYERS = 4
VOCAB = 1024
K2_YARN = dict(
    type="yarn",
    factor=64.0,
    original_max_position_embeddings=4096,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=1.0,
)

DRAFTER_CONFIG = dict(
    architectures=["DFlashDraftModel"],
    model_type="qwen3",
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=262144,
    rope_theta=50000.0,
    rope_scaling=K2_YARN,
    attention_bias=False,
    tie_word_embeddings=False,
    num_target_layers=NUM_TARGET_LAYERS,
    block_size=8,
    dflash_config=dict(
        mask_token_id=VOCAB - 2,
        target_layer_ids=[1, 2],
        output_multiplier=0.8,
        final_logit_softcapping=6.0,
        input_embedding_scale=1.5,
    ),
)

# Rope configs whose cos/sin tables the JAX side must reproduce (HF's Qwen3RotaryEmbedding is the reference).
ROPE_CASES = {
    "default": dict(rope_theta=10000.0),
    "yarn_k2": dict(rope_theta=50000.0, rope_scaling=K2_YARN),
    "yarn_no_mscale_all_dim": dict(
        rope_theta=50000.0,
        rope_scaling=dict(type="yarn", factor=16.0, original_max_position_embeddings=2048, mscale=1.0),
    ),
    "yarn_attention_factor_no_truncate": dict(
        rope_theta=1e6,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=1e6,
            factor=8.0,
            original_max_position_embeddings=1024,
            beta_fast=16.0,
            beta_slow=2.0,
            attention_factor=0.9,
            truncate=False,
        ),
    ),
}
ROPE_POSITIONS = np.array([0, 1, 2, 7, 31, 100, 1023, 4095, 5000, 70000], dtype=np.int64)


class StubTarget(nn.Module):
    """Just what the drafter borrows from the target: the input embedding and the lm_head."""

    def __init__(self, hidden, vocab, gen):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.randn(vocab, hidden, generator=gen))
            self.lm_head.weight.copy_(torch.randn(vocab, hidden, generator=gen) * 3.0 / hidden**0.5)

    def get_input_embeddings(self):
        return self.embed_tokens


def randomize_(model, gen):
    """Random weights, every tensor distinct (norm weights near 1), rounded to bf16 so the bf16 file is exact."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def run_drafter(model, target, features, block_ids, positions, cache=None):
    """dflash_generate's drafter call: rows 1..b-1 of the block -> (final hidden, logits, per-layer hidden)."""
    per_layer = []
    hooks = [layer.register_forward_hook(lambda m, i, o: per_layer.append(o)) for layer in model.layers]
    scale = float(model.config.dflash_config["input_embedding_scale"])
    noise = _raw_input_embeddings(target, block_ids, scale)
    hidden = model(
        target_hidden=features,
        noise_embedding=noise,
        position_ids=positions,
        past_key_values=cache,
        use_cache=cache is not None,
    )
    for h in hooks:
        h.remove()
    logits = model.compute_logits(hidden[:, 1:], _output_head(target))
    return hidden, logits, torch.stack(per_layer)


def rope_tables():
    out = {}
    for name, fields in ROPE_CASES.items():
        cfg = Qwen3Config(hidden_size=128, num_attention_heads=4, head_dim=32, max_position_embeddings=262144, **fields)
        rotary = Qwen3RotaryEmbedding(cfg)
        x = torch.zeros(1, dtype=torch.float32)
        cos, sin = rotary(x, torch.from_numpy(ROPE_POSITIONS)[None])
        out[f"rope_{name}_cos"] = cos[0].numpy()
        out[f"rope_{name}_sin"] = sin[0].numpy()
        out[f"rope_{name}_config"] = np.array(json.dumps(fields))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "dflash"))
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(20260612)
    torch.set_default_dtype(torch.float32)

    config = Qwen3Config(**DRAFTER_CONFIG)
    model = DFlashDraftModel(config).eval()
    randomize_(model, gen)
    target = StubTarget(config.hidden_size, VOCAB, gen).eval()
    block = model.block_size

    # Target hidden states: index 0 is the embedding output, i + 1 the output of target layer i.
    target_hidden = [
        torch.randn(BATCH, CTX_LEN, config.hidden_size, generator=gen) * 2.0 for _ in range(NUM_TARGET_LAYERS + 1)
    ]
    features = extract_context_feature(target_hidden, model.target_layer_ids)
    bonus_ids = torch.randint(0, VOCAB - 2, (BATCH,), generator=gen)
    block_ids = torch.full((BATCH, block), model.mask_token_id, dtype=torch.long)
    block_ids[:, 0] = bonus_ids
    positions = torch.arange(CTX_LEN + block)[None].expand(BATCH, -1)

    with torch.inference_mode():
        hidden, logits, per_layer = run_drafter(model, target, features, block_ids, positions)
        # Batch row 1 with a shorter context: positions restart at 0, the block follows the 6 context rows.
        _, logits_short, _ = run_drafter(
            model, target, features[1:, :SHORT_CTX_LEN], block_ids[1:], positions[1:, : SHORT_CTX_LEN + block]
        )
        # The reference's own cached path, as dflash_generate runs it: round 1 feeds context rows [0, SPLIT),
        # crops the block away, round 2 feeds rows [SPLIT, CTX_LEN). It must equal the full forward.
        cache = DynamicCache(config=config)
        run_drafter(model, target, features[:, :SPLIT], block_ids, positions[:, : SPLIT + block], cache)
        _crop_to(cache, SPLIT)
        _, logits_cached, _ = run_drafter(model, target, features[:, SPLIT:], block_ids, positions[:, SPLIT:], cache)
    cached_err = float((logits_cached - logits).abs().max() / logits.abs().max())
    assert cached_err < 1e-5, f"reference cached path differs from its full forward: {cached_err}"

    drafter_dir = os.path.join(args.out, "drafter")
    os.makedirs(drafter_dir, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(drafter_dir)

    arrays = dict(
        embed_VD=target.embed_tokens.weight.detach().numpy(),
        lm_head_DV=target.lm_head.weight.detach().T.contiguous().numpy(),
        context_features=features.numpy(),
        bonus_ids=bonus_ids.numpy().astype(np.int32),
        block_ids=block_ids.numpy().astype(np.int32),
        layer_hidden=per_layer.numpy(),  # [n_layers, B, b, H]: output of each draft layer (pre-norm)
        final_hidden=hidden.numpy(),  # [B, b, H]: after the final norm
        logits=logits.numpy(),  # [B, b-1, V]
        logits_short_row1=logits_short.numpy(),  # [1, b-1, V]: batch row 1, first SHORT_CTX_LEN context rows
        short_ctx_len=np.int32(SHORT_CTX_LEN),
        rope_positions=ROPE_POSITIONS,
        **rope_tables(),
    )
    np.savez_compressed(os.path.join(args.out, "reference.npz"), **arrays)
    provenance = dict(
        generator="scripts/make_dflash_fixtures.py",
        versions={p: version(p) for p in ("torch", "transformers", "dflash")},
        reference_cached_vs_full_rel_err=cached_err,
        shapes={k: list(v.shape) for k, v in arrays.items()},
    )
    with open(os.path.join(args.out, "provenance.json"), "w") as f:
        json.dump(provenance, f, indent=1)
    print(json.dumps(provenance["versions"]), "cached-vs-full", cached_err)


if __name__ == "__main__":
    main()
