"""The K2 tiktoken tokenizer read from a checkpoint dir: `tiktoken.model`, special tokens, chat template."""

from __future__ import annotations

import base64
import binascii
import codecs
import json
import os

import jinja2
import tiktoken

# Kimi's pre-tokenizer regex (tokenization_kimi.py): Han runs, cased words, 1-3 digit numbers, punctuation.
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def read_ranks(path: str) -> dict[bytes, int]:
    """The BPE ranks of a tiktoken.model file (`base64(token bytes) rank` lines), read from the file itself:
    tiktoken's load_tiktoken_bpe caches every path it reads in a temp dir, so a rewritten file would load stale."""
    ranks = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise ValueError(f"{path}:{n}: not a `base64(token) rank` line") from None
    return ranks


class Tokenizer:
    def __init__(self, ckpt_dir: str):
        model_file = os.path.join(ckpt_dir, "tiktoken.model")
        config_file = os.path.join(ckpt_dir, "tokenizer_config.json")
        for f in (model_file, config_file):
            if not os.path.isfile(f):
                raise FileNotFoundError(f"{f}: tokenizer file missing from the checkpoint directory")
        ranks = read_ranks(model_file)
        with open(config_file) as f:
            config = json.load(f)
        special = {v["content"]: int(k) for k, v in config.get("added_tokens_decoder", {}).items()}
        self.encoding = tiktoken.Encoding(
            name=os.path.basename(os.path.abspath(ckpt_dir)),
            pat_str=KIMI_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=special,
        )
        self.special = special
        self.chat_template = jinja2.Environment().from_string(config.get("chat_template") or DEFAULT_CHAT_TEMPLATE)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids], errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.chat_template.render(messages=messages, add_generation_prompt=add_generation_prompt))


class StreamDecoder:
    """Turns token ids into text as they arrive, holding back a multi-byte character until it is whole (the
    tokenizer is byte-level: one token may end in the middle of a UTF-8 sequence)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids) -> str:
        return self.utf8.decode(self.tokenizer.encoding.decode_bytes([int(i) for i in ids]))

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)
