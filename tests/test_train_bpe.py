"""k26jax.train.bpe: a small BPE trained on 20 stdlib files, written in K2.6's format and read back by
k26jax.tokenizer.Tokenizer, must encode held-out files, non-ASCII text and special tokens exactly as the trainer."""

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from tokenizers import pre_tokenizers  # noqa: E402

from convert import make_tiny  # noqa: E402
from k26jax import hf as k26hf  # noqa: E402
from k26jax.tokenizer import Tokenizer  # noqa: E402
from k26jax.train import bpe, corpus  # noqa: E402

V = 1024  # 768 BPE ranks + K2's 256 special tokens
EXTRA = [
    "Café 日本語",
    "x = 'naïve' # ÄÖÜ ß — “quotes” 中文字符 😀 e\u0301 ǅ ʰ ١٢٣ Ⅻ\u00a0\u2003\u3000end\n",
    "  \t\r\n\r\n   def f():\n\treturn 1234567  \n\n\n",
    "<|im_user|>user<|im_middle|>Café 日本語<|im_end|><|im_assistant|>assistant<|im_middle|><think>ok</think>[EOS]",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    train_files, held_files = corpus.split_files(corpus.stdlib_files())
    texts = corpus.read_texts(train_files[::25][:20])
    held_texts = corpus.read_texts(held_files)
    held = [t for t in held_texts if not t.isascii()][:1] + [t for t in held_texts if len(t) < 20000][:4]
    hf = bpe.train_hf_bpe(texts, V - k26hf.NUM_SPECIAL)
    ranks = bpe.hf_ranks(hf)
    out = tmp_path_factory.mktemp("tok")
    k26hf.write_tokenizer(str(out), ranks, k26hf.special_tokens(V))
    return hf, ranks, out, Tokenizer(str(out)), held


def test_ranks_bytes_first_then_merges(trained):
    hf, ranks, *_ = trained
    assert len(ranks) == V - 256 and sorted(ranks.values()) == list(range(V - 256))
    assert all(ranks[bytes([b])] == b for b in range(256))
    by_rank = sorted(ranks, key=ranks.get)
    assert all(len(t) >= 2 for t in by_rank[256:])
    assert ranks == bpe.train_bpe(corpus.read_texts(corpus.split_files(corpus.stdlib_files())[0][::25][:20]), V)


def test_byte_level_table_is_tokenizers_own():
    table = bpe.byte_level_chars()
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet()) and sorted(table.values()) == list(range(256))
    text = "".join(EXTRA) + "".join(map(chr, range(1, 0x250)))
    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    assert bytes(table[c] for s, _ in pieces for c in s) == text.encode()


def test_tiktoken_encodes_exactly_as_the_trainer(trained):
    hf, ranks, _, tok, held = trained
    texts = held + EXTRA
    assert any(not t.isascii() for t in held)
    hf_encode = bpe.hf_encoder(hf, ranks, k26hf.special_tokens(V))
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf_encode(text)
        assert tok.decode(ids) == text
    ascii_text = next(t for t in held if t.isascii())  # token boundaries straight from tokenizers' offsets
    enc = hf.encode(ascii_text, add_special_tokens=False)
    assert [ascii_text[a:b].encode() for a, b in enc.offsets] == [
        tok.encoding.decode_single_token_bytes(i) for i in tok.encode(ascii_text)
    ]
    special = tok.encode(EXTRA[-1])
    assert special[0] == V - 256 + 3 and special[-1] == V - 255 and tok.special["<|im_end|>"] == V - 254
    assert max(tok.encode("".join(held))) < V - 256


def test_mask_token_is_never_produced_by_text(trained):
    *_, tok, _ = trained
    assert bpe.mask_token_id(V) == tok.special[bpe.MASK_TOKEN] == V - 2 and bpe.mask_token_id() == 4094
    (ids,) = corpus.encode_texts(tok, ["x = '[UNK]' # [EOS] <|im_end|>"])
    assert ids.max() < V - 256 and tok.decode(ids) == "x = '[UNK]' # [EOS] <|im_end|>"


def test_config_matches_make_tiny_format(trained, tmp_path):
    out = trained[2]
    make_tiny.write_tokenizer(str(tmp_path), V)
    with open(out / "tokenizer_config.json") as a, open(tmp_path / "tokenizer_config.json") as b:
        assert json.load(a) == json.load(b)
    with open(out / "tiktoken.model") as f:
        lines = f.read().splitlines()
    assert len(lines) == V - 256 and lines[65] == "QQ== 65"


def test_write_tokenizer_rejects_bad_ranks(tmp_path):
    with pytest.raises(ValueError, match="collides"):
        k26hf.write_tokenizer(str(tmp_path), {bytes([b]): b for b in range(256)}, {100: "[BOS]"})
    with pytest.raises(ValueError, match="0..len"):
        k26hf.write_tokenizer(str(tmp_path), {b"a": 0, b"b": 2})


def test_token_arrays_are_the_tokenizers_encoding(trained, tmp_path):
    *_, tok, _ = trained
    files = corpus.stdlib_files()
    subset = corpus.split_files(files)[0][:3] + corpus.split_files(files)[1][:3]
    m = corpus.write_token_arrays(tok, str(tmp_path), sorted(subset), n_prompts=2)
    for split, names in zip(("train", "heldout"), corpus.split_files(sorted(subset))):
        want = [i for t in corpus.read_texts(names) for i in tok.encode(t) + [tok.special["[EOS]"]]]
        got = np.load(tmp_path / f"{split}.npy")
        assert got.dtype == np.int32 and got.tolist() == want and m[f"{split}_tokens"] == len(want)
    prompts = np.load(tmp_path / "heldout_prompts.npy")
    long_held = [f for f in corpus.split_files(sorted(subset))[1] if len(tok.encode(corpus.read_texts([f])[0])) >= 256]
    assert m["heldout_prompt_files"] == long_held[:2] and prompts.shape == (len(long_held[:2]), 256)
    for row, f in zip(prompts, long_held):
        assert row.tolist() == tok.encode(corpus.read_texts([f])[0])[:256]


def test_cli_trains_on_a_small_root(tmp_path, capsys):
    files = corpus.stdlib_files()
    root = tmp_path / "stdlib"
    for rel in corpus.split_files(files)[0][::25][:20] + corpus.split_files(files)[1][:3]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f"{corpus.stdlib_root()}/{rel}", root / rel)
    out = tmp_path / "tok"
    bpe.main(["--out", str(out), "--vocab", str(V), "--root", str(root), "--any-python"])
    m = json.loads((out / "corpus_manifest.json").read_text())
    assert (m["num_files"], m["num_heldout_files"], m["vocab_size"], m["dflash_mask_token_id"]) == (23, 3, V, V - 2)
    assert m["heldout_encoding_checked"] == 3 and 0.1 < m["train_tokens_per_byte"] < 1
    assert Tokenizer(str(out)).decode(Tokenizer(str(out)).encode("Café 日本語")) == "Café 日本語"
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        bpe.main(["--out", str(out), "--root", str(root), "--any-python"])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_a_rewritten_tokenizer_is_read_afresh(trained, tmp_path):
    """tiktoken's load_tiktoken_bpe caches by path: a tokenizer retrained into the same directory (train_mini
    --overwrite) must not load the old ranks."""
    _, ranks, _, _, _ = trained
    small = {t: r for t, r in ranks.items() if r < 256}  # the byte ranks only
    k26hf.write_tokenizer(str(tmp_path), ranks, k26hf.special_tokens(V))
    assert Tokenizer(str(tmp_path)).encoding.n_vocab == V
    k26hf.write_tokenizer(str(tmp_path), small)
    again = Tokenizer(str(tmp_path))
    assert again.encoding.n_vocab == 256 + k26hf.NUM_SPECIAL
    assert len(again.encode("def main():")) == len("def main():".encode())  # bytes alone: one id a byte


def test_a_malformed_rank_line_names_the_file_and_line(tmp_path):
    from k26jax.tokenizer import read_ranks

    (tmp_path / "tiktoken.model").write_text("IQ== 0\nnot-base64! 1\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:2: not a `base64\(token\) rank` line"):
        read_ranks(str(tmp_path / "tiktoken.model"))
