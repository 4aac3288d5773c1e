"""make_tiny: the K2.6 on-disk format, the INT4 packer against compressed-tensors, the tokenizer, the drafter."""

import base64
import filecmp
import json
import os

import jinja2
import numpy as np
import pytest
from safetensors import safe_open

from convert import make_tiny
from k26jax import hf as hf_layout
from k26jax import hf_files
from k26jax.config import DrafterConfig, ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "checkpoints", "tiny")
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "int4_pack.npz")


@pytest.fixture(scope="module")
def int4():
    return np.load(FIXTURE)


def test_pack_int4_matches_compressed_tensors(int4):
    q = int4["q_int"]
    assert q.min() == -8 and q.max() == 7
    np.testing.assert_array_equal(hf_layout.pack_int4(q), int4["packed"])
    assert hf_layout.pack_int4(np.array([[1, -1, 0, 7, -7, 2, -2, 3]]))[0, 0] == -1230899079  # 0xB6A1F879
    np.testing.assert_array_equal(hf_layout.unpack_int4_rows(int4["packed"].T).T, int4["unpacked"])


@pytest.mark.parametrize(
    "q, match",
    [(np.full((2, 8), 8), r"\[-8, 7\]"), (np.zeros((2, 12), np.int8), "multiple"), (np.full((2, 8), -9), r"\[-8, 7\]")],
)
def test_pack_int4_rejects_bad_input(q, match):
    with pytest.raises(ValueError, match=match):
        hf_layout.pack_int4(q)


def test_committed_tiny_is_what_make_tiny_writes(tmp_path):
    """If this fails after a change to make_tiny, the presets or the drafter init, regenerate the committed copy:
    rm -r checkpoints/tiny && python -m convert.make_tiny --out checkpoints/tiny"""
    make_tiny.make_tiny(str(tmp_path / "t"))
    cmp = filecmp.dircmp(TINY, tmp_path / "t")
    assert not cmp.left_only and not cmp.right_only
    for sub in ("", "drafter"):
        names = sorted(os.listdir(os.path.join(TINY, sub)))
        _, mismatch, errors = filecmp.cmpfiles(
            os.path.join(TINY, sub), tmp_path / "t" / sub, [n for n in names if n != "drafter"], shallow=False
        )
        assert not mismatch and not errors, (sub, mismatch, errors)


def test_k26_on_disk_format():
    with open(os.path.join(TINY, "config.json")) as f:
        raw = json.load(f)
    assert raw["model_type"] == "kimi_k25" and raw["text_config"]["model_type"] == "kimi_k2"
    assert raw["text_config"]["quantization_config"]["format"] == "pack-quantized"
    cfg = ModelConfig.from_hf_dir(TINY)
    V = cfg.vocab_size
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (V - 256, (V - 255, V - 254), V - 1)
    assert raw["media_placeholder_token_id"] == V - 235
    with open(os.path.join(TINY, hf_files.INDEX_FILE)) as f:
        weight_map = json.load(f)["weight_map"]
    shards = set(weight_map.values())
    assert len(shards) >= 3 and all(s.endswith("-of-%06d.safetensors" % len(shards)) for s in shards)
    for group in ("vision_tower.", "mm_projector."):
        assert any(n.startswith(group) for n in weight_map)
    text = [n for n in weight_map if not n.startswith(("vision_tower.", "mm_projector."))]
    assert all(n.startswith("language_model.") for n in text)
    first_moe = cfg.layer_kinds.index("moe")
    expert0 = {
        weight_map[f"language_model.model.layers.{first_moe}.mlp.experts.0.{p}.weight_packed"]
        for p in ("gate_proj", "up_proj", "down_proj")
    }
    assert len(expert0) > 1, "one expert's projections must straddle shards"
    name = f"language_model.model.layers.{first_moe}.mlp.experts.3.down_proj."
    with safe_open(os.path.join(TINY, weight_map[name + "weight_shape"]), "numpy") as f:
        shape = f.get_tensor(name + "weight_shape")
        assert shape.dtype == np.int32 and shape.tolist() == [cfg.hidden_size, cfg.moe_intermediate_size]
    with safe_open(os.path.join(TINY, weight_map[name + "weight_packed"]), "numpy") as f:
        assert f.get_slice(name + "weight_packed").get_dtype() == "I32"
        assert f.get_slice(name + "weight_scale").get_dtype() == "BF16"
    bias = f"language_model.model.layers.{first_moe}.mlp.gate.e_score_correction_bias"
    with safe_open(os.path.join(TINY, weight_map[bias]), "numpy") as f:
        assert f.get_slice(bias).get_dtype() == "F32"
    hf_layout.validate(hf_files.HFCheckpoint(TINY), cfg)


def test_tokenizer_files():
    cfg = ModelConfig.from_hf_dir(TINY)
    V = cfg.vocab_size
    with open(os.path.join(TINY, "tiktoken.model")) as f:
        ranks = {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in f)}
    assert sorted(ranks.values()) == list(range(V - 256))
    assert all(ranks[bytes([b])] == b for b in range(256))
    for token in ranks:  # every merged token splits into two tokens of lower rank (a valid BPE merge)
        if len(token) > 1:
            assert any(
                token[:i] in ranks and token[i:] in ranks and max(ranks[token[:i]], ranks[token[i:]]) < ranks[token]
                for i in range(1, len(token))
            ), token
    with open(os.path.join(TINY, "tokenizer_config.json")) as f:
        tok_cfg = json.load(f)
    special = {int(i): v["content"] for i, v in tok_cfg["added_tokens_decoder"].items()}
    assert sorted(special) == list(range(V - 256, V))
    for k2_id, token in (
        (163584, "[BOS]"),
        (163585, "[EOS]"),
        (163586, "<|im_end|>"),
        (163601, "<|im_middle|>"),
        (163838, "[UNK]"),
        (163839, "[PAD]"),
    ):
        assert special[k2_id - 163840 + V] == token
    assert special[V - 3] == f"<|reserved_token_{V - 3}|>"
    prompt = jinja2.Template(tok_cfg["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert prompt.endswith("<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>")


def test_write_tokenizer_refuses_bad_ranks(tmp_path):
    with pytest.raises(ValueError, match="0..len"):
        hf_layout.write_tokenizer(str(tmp_path), {b"a": 0, b"b": 2})
    with pytest.raises(ValueError, match="collides"):
        hf_layout.write_tokenizer(str(tmp_path), {bytes([b]): b for b in range(256)}, {100: "[BOS]"})


def test_drafter_matches_target():
    cfg = ModelConfig.from_hf_dir(TINY)
    dcfg = DrafterConfig.from_hf_dir(os.path.join(TINY, "drafter"))
    dcfg.check_target(cfg)
    assert (dcfg.hidden_size, dcfg.num_hidden_layers, dcfg.block_size) == (256, 2, 8)
    assert (dcfg.target_layer_ids, dcfg.mask_token_id) == ((1, 2), cfg.vocab_size - 2)


def test_experts_override_and_bpe_fill():
    text = make_tiny.tiny_text_config("k26-depth2", experts=96)
    cfg = ModelConfig.from_hf_dict(make_tiny.hf_config(text))
    assert (cfg.n_routed_experts, cfg.num_hidden_layers, cfg.hidden_size) == (96, 2, 7168)
    assert (cfg.bos_token_id, cfg.pad_token_id) == (163584, 163839)
    assert len(make_tiny.bpe_ranks(4000)) == 4000


@pytest.mark.parametrize(
    "args,said",
    [
        (["--preset", "bogus"], "unknown preset 'bogus'"),
        (["--experts", "3"], "num_experts_per_tok"),
        (["--out", "FILE"], "exists and is not a directory"),
        (["--out", "FULL"], "directory exists and is not empty"),
    ],
)
def test_a_users_mistake_is_one_line_and_writes_nothing(tmp_path, capsys, args, said):
    (tmp_path / "FILE").write_text("not ours")
    (tmp_path / "FULL").mkdir()
    (tmp_path / "FULL" / "x").write_text("not ours")
    args = [str(tmp_path / a) if a in ("FILE", "FULL") else a for a in args]
    out = args[args.index("--out") + 1] if "--out" in args else str(tmp_path / "new")
    before = sorted(os.listdir(tmp_path))
    assert make_tiny.main(["--out", out, *args]) == 2
    assert said in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == before  # no half-written output, nothing of ours left behind
    assert (tmp_path / "FULL" / "x").read_text() == (tmp_path / "FILE").read_text() == "not ours"


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def fail(*_):
        raise OSError("disk full")

    monkeypatch.setattr(make_tiny, "write_tokenizer", fail)
    with pytest.raises(OSError, match="disk full"):
        make_tiny.make_tiny(str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []
