"""A byte-level BPE for k26-mini, trained with HF `tokenizers` and written in K2.6's tiktoken checkpoint format.

The trainer splits text with K2's own tiktoken pattern (k26jax.tokenizer.KIMI_PAT_STR, run by tokenizers' regex)
and then maps each byte to GPT-2's printable stand-in character (ByteLevel, no prefix space, no second regex), so
its merges see exactly the pieces tiktoken's encoder sees. Ranks: byte b at rank b, then each merge's new token in
merge order. The top 256 ids are K2's special tokens at K2's offsets from the top of the vocabulary (make_tiny's
layout); for 4096 ids: [BOS] 3840, [EOS] 3841, <|im_end|> 3842, ..., [UNK] 4094, [PAD] 4095.

DFlash MASK = "[UNK]" (vocab - 2, K2.6 DFlash's 163838): ordinary text never encodes to it, so the target never
sees or emits it.

    python -m k26jax.train.bpe --out DIR [--vocab 4096] [--overwrite] [--any-python]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

from k26jax.hf import NUM_SPECIAL, special_tokens, write_tokenizer
from k26jax.tokenizer import KIMI_PAT_STR
from k26jax.train import corpus

VOCAB_SIZE = 4096
MASK_TOKEN = "[UNK]"


def mask_token_id(vocab_size: int = VOCAB_SIZE) -> int:
    """The DFlash MASK id: MASK_TOKEN's id in the vocabulary of `vocab_size` ids (vocab_size - 2)."""
    return {t: i for i, t in special_tokens(vocab_size).items()}[MASK_TOKEN]


def byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-to-unicode table inverted (what tokenizers' ByteLevel uses): printable Latin-1 bytes stand for
    themselves, the other 68 bytes become chr(256 + k) in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + k): b for k, b in enumerate(moved)}


def _token_bytes(token: str, table: dict[str, int]) -> bytes:
    return bytes(table[c] for c in token)


def train_hf_bpe(texts: list[str], num_ranks: int, progress: bool = False):
    """A tokenizers.Tokenizer with `num_ranks` byte-level tokens (256 bytes + merges) trained on `texts`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=num_ranks, show_progress=progress, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    hf.train_from_iterator(texts, trainer, length=len(texts))
    return hf


def hf_ranks(hf) -> dict[bytes, int]:
    """tiktoken mergeable ranks of a trained byte-level HF BPE: bytes at their own values, then merge order (a
    merge that rebuilds an existing token adds no rank)."""
    table = byte_level_chars()
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(hf.to_str())["model"]["merges"]:
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        ranks.setdefault(_token_bytes(a + b, table), len(ranks))
    return ranks


def train_bpe(
    texts: list[str], vocab_size: int = VOCAB_SIZE, special_tokens: dict[int, str] | None = None, progress=False
) -> dict[bytes, int]:
    """Ranks [0, vocab_size - len(special_tokens)) of a byte-level BPE trained on `texts`; the special tokens
    (default: K2's 256, `k26jax.hf.special_tokens`) take the remaining top ids."""
    n_special = NUM_SPECIAL if special_tokens is None else len(special_tokens)
    return _train(texts, vocab_size - n_special, progress)[1]


def _train(texts: list[str], num_ranks: int, progress: bool):
    hf = train_hf_bpe(texts, num_ranks, progress)
    ranks = hf_ranks(hf)
    if len(ranks) != num_ranks:
        raise ValueError(f"the corpus supports only {len(ranks)} BPE tokens, {num_ranks} asked")
    return hf, ranks


def hf_encoder(hf, ranks: dict[bytes, int], specials: dict[int, str]) -> Callable[[str], list[int]]:
    """text -> ids of the written tokenizer, computed by the HF tokenizer `hf` (its specials added to it)."""
    hf.add_special_tokens(list(specials.values()))
    table = byte_level_chars()
    by_content = {t: i for i, t in specials.items()}
    to_id = {}
    for token, hf_id in hf.get_vocab(with_added_tokens=True).items():
        to_id[hf_id] = by_content[token] if token in by_content else ranks[_token_bytes(token, table)]
    return lambda text: [to_id[i] for i in hf.encode(text, add_special_tokens=False).ids]


def main(argv=None) -> None:
    from k26jax.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(prog="python -m k26jax.train.bpe", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="new (or empty) directory for the tokenizer files")
    parser.add_argument("--vocab", type=int, default=VOCAB_SIZE, help="total ids, the 256 special tokens included")
    parser.add_argument("--overwrite", action="store_true", help="rewrite the files of a non-empty --out")
    parser.add_argument("--any-python", action="store_true", help="use this stdlib even if it differs from data/")
    parser.add_argument("--root", help="stdlib directory (default: this interpreter's)")
    args = parser.parse_args(argv)
    corpus.refuse_nonempty(args.out, args.overwrite)
    t0 = time.time()
    files = corpus.corpus_files(args.root, args.any_python)
    train_files, held_files = corpus.split_files(files)
    try:
        train_texts = corpus.read_texts(train_files, args.root)
        held_texts = corpus.read_texts(held_files, args.root)
    except corpus.CorpusError as e:
        corpus.log(f"error: {e}")
        raise SystemExit(2)
    n_train_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    corpus.log(f"corpus: {len(train_files)} train files ({n_train_bytes:,} bytes), {len(held_files)} held out")

    corpus.log(f"training a byte-level BPE of {args.vocab - NUM_SPECIAL} ranks + {NUM_SPECIAL} special tokens ...")
    specials = special_tokens(args.vocab)
    hf, ranks = _train(train_texts, args.vocab - NUM_SPECIAL, progress=sys.stderr.isatty())
    write_tokenizer(args.out, ranks, specials)
    t_train = time.time() - t0
    corpus.log(f"trained and wrote {args.out} ({t_train:.1f}s); checking tiktoken == trainer on held-out files ...")

    tok = Tokenizer(args.out)
    hf_encode = hf_encoder(hf, ranks, specials)
    bad = [f for f, t in zip(held_files, held_texts) if tok.encode(t) != hf_encode(t)]
    if bad:
        corpus.log(f"error: tiktoken and the trainer encode {len(bad)} held-out files differently: {bad[:5]}")
        raise SystemExit(1)
    manifest = corpus.corpus_manifest(args.root, files)
    for split, texts in (("train", train_texts), ("heldout", held_texts)):
        n_tok = sum(map(len, corpus.encode_texts(tok, texts)))
        manifest[f"{split}_text_tokens"] = n_tok
        manifest[f"{split}_tokens_per_byte"] = round(n_tok / sum(len(t.encode("utf-8")) for t in texts), 4)
    ids = {t: i for i, t in specials.items()}
    manifest.update(
        vocab_size=args.vocab,
        bpe_ranks=len(ranks),
        num_special=len(specials),
        special_ids={t: ids[t] for t in ("[BOS]", "[EOS]", "<|im_end|>", MASK_TOKEN, "[PAD]")},
        dflash_mask_token=MASK_TOKEN,
        dflash_mask_token_id=ids[MASK_TOKEN],
        heldout_encoding_checked=len(held_files),
        seconds=round(time.time() - t0, 1),
    )
    with open(os.path.join(args.out, "corpus_manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    corpus.log(
        f"done in {manifest['seconds']}s: vocab {args.vocab}, train {manifest['train_text_tokens']:,} tokens "
        f"({manifest['train_tokens_per_byte']} per byte), held-out {manifest['heldout_text_tokens']:,} tokens "
        f"({manifest['heldout_tokens_per_byte']} per byte); MASK {MASK_TOKEN} = {ids[MASK_TOKEN]}"
    )


if __name__ == "__main__":
    main()
