"""The k26-mini corpus: the Python standard library's own .py source, split by whole files into train and held-out.

Files: every .py under `sysconfig.get_paths()["stdlib"]` whose relative path has no `site-packages`, `test`, `tests`
or `idlelib` directory component, named by their '/'-separated relative path, in sorted order. The list used is
committed as data/stdlib_files.txt (`write_file_list`). Texts are the files' exact bytes decoded as strict UTF-8.

Token arrays: each file's tokens then [EOS], concatenated in file order, int32. Source is encoded as ordinary text,
so a literal "[UNK]" in a file is bytes, never a special id: the DFlash MASK never occurs in the data.

    python -m k26jax.train.corpus --tokenizer DIR --out DATA_DIR [--overwrite] [--any-python]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

EXCLUDED_DIRS = ("site-packages", "test", "tests", "idlelib")
HELDOUT_BUCKETS = 10
EOS_TOKEN = "[EOS]"
FILE_LIST = Path(__file__).resolve().parents[2] / "data" / "stdlib_files.txt"


class CorpusError(ValueError):
    """The corpus on this machine cannot be used as asked (undecodable files, a different file list)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
    """Relative '/'-separated paths of the corpus .py files under `root` (default: this interpreter's stdlib),
    sorted; a directory named in EXCLUDED_DIRS is skipped at any depth."""
    root = root or stdlib_root()
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = [x for x in dirs if x not in EXCLUDED_DIRS]
        rel = os.path.relpath(d, root)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        out += [prefix + n for n in names if n.endswith(".py") and os.path.isfile(os.path.join(d, n))]
    return sorted(out)


def is_heldout(relpath: str) -> bool:
    """Held out iff bucket 0 of 10: the SHA-256 digest of the relative path's UTF-8 bytes, read as one big-endian
    unsigned integer (= int(hexdigest, 16)), modulo 10 equals 0. Stable across runs and machines, unlike hash()."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest, "big") % HELDOUT_BUCKETS == 0


def split_files(files: list[str]) -> tuple[list[str], list[str]]:
    """(train, held_out), each in the input order."""
    return [f for f in files if not is_heldout(f)], [f for f in files if is_heldout(f)]


def file_list_hash(files: list[str]) -> str:
    """SHA-256 hex of the paths in the given order, each followed by '\\n', UTF-8."""
    return hashlib.sha256("".join(f + "\n" for f in files).encode("utf-8")).hexdigest()


def read_texts(files: list[str], root: str | None = None) -> list[str]:
    """The files' texts (strict UTF-8, no newline translation); CorpusError naming every undecodable file."""
    root = root or stdlib_root()
    texts, bad = [], []
    for f in files:
        data = Path(root, f).read_bytes()
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            bad.append(f"{f} (byte {data[e.start]:#04x} at offset {e.start})")
    if bad:
        raise CorpusError(f"{len(bad)} corpus file(s) are not UTF-8, refusing to guess an encoding: {', '.join(bad)}")
    return texts


def corpus_manifest(root: str | None = None, files: list[str] | None = None) -> dict:
    """What the corpus is: interpreter, stdlib root, the split rule, file and byte counts, list and content hashes."""
    root = root or stdlib_root()
    files = stdlib_files(root) if files is None else files
    train, held = split_files(files)
    content = hashlib.sha256()
    for f in files:
        content.update(Path(root, f).read_bytes())
    return {
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "stdlib_root": root,
        "excluded_dirs": list(EXCLUDED_DIRS),
        "heldout_rule": "int(sha256(relpath.encode('utf-8')).hexdigest(), 16) % 10 == 0",
        "num_files": len(files),
        "num_train_files": len(train),
        "num_heldout_files": len(held),
        "train_bytes": sum(os.path.getsize(os.path.join(root, f)) for f in train),
        "heldout_bytes": sum(os.path.getsize(os.path.join(root, f)) for f in held),
        "file_list_sha256": file_list_hash(files),
        "content_sha256": content.hexdigest(),
    }


def write_file_list(path: str | Path, files: list[str]) -> None:
    """data/stdlib_files.txt: a '#' header naming the Python version, then `relpath<TAB>train|heldout` lines."""
    n_held = sum(map(is_heldout, files))
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            f"# Python {platform.python_version()} standard library .py files (k26jax.train.corpus): {len(files)} "
            f"files, {n_held} held out (sha256 bucket 0 of 10); file list sha256 {file_list_hash(files)}\n"
        )
        f.write("# relpath<TAB>split\n")
        for rel in files:
            f.write(f"{rel}\t{'heldout' if is_heldout(rel) else 'train'}\n")


def read_file_list(path: str | Path = FILE_LIST) -> list[str]:
    """The relative paths of a `write_file_list` file, in its order."""
    with open(path, encoding="utf-8") as f:
        return [line.split("\t")[0] for line in f.read().splitlines() if line and not line.startswith("#")]


def check_committed(files: list[str], path: str | Path = FILE_LIST) -> None:
    """CorpusError unless `files` is exactly the committed list (another Python version gives another corpus)."""
    committed = read_file_list(path)
    if files == committed:
        return
    added, missing = sorted(set(files) - set(committed)), sorted(set(committed) - set(files))
    raise CorpusError(
        f"this interpreter's stdlib (Python {platform.python_version()}, {len(files)} files) differs from {path} "
        f"({len(committed)} files): {len(added)} extra {added[:3]}, {len(missing)} missing {missing[:3]}"
    )


def eos_id(tok) -> int:
    return tok.special[EOS_TOKEN]


def encode_texts(tok, texts: list[str]) -> list[np.ndarray]:
    """Each text's ids (int32) through the k26jax tiktoken Tokenizer, specials not recognised in the text."""
    return [np.asarray(ids, np.int32) for ids in tok.encoding.encode_ordinary_batch(texts, num_threads=2)]


def join_docs(docs: list[np.ndarray], eos: int) -> np.ndarray:
    """int32 [sum(len(d) + 1)]: every document followed by the `eos` separator."""
    sep = np.array([eos], np.int32)
    return np.concatenate([x for d in docs for x in (d, sep)]) if docs else np.zeros(0, np.int32)


def batches(tokens: np.ndarray, seq_len: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
    """Endless int32 [batch_size, seq_len] windows of `tokens` at uniform random starts (windows may cross [EOS]
    separators); the sequence is a function of `seed` alone."""
    if len(tokens) < seq_len:
        raise ValueError(f"{len(tokens)} tokens is shorter than one window of {seq_len}")
    rng = np.random.default_rng(seed)
    offsets_L = np.arange(seq_len)
    while True:
        starts_B = rng.integers(0, len(tokens) - seq_len + 1, size=batch_size)
        yield np.asarray(tokens[starts_B[:, None] + offsets_L], np.int32)


def heldout_prompts(
    tok, n: int = 64, prompt_tokens: int = 256, root: str | None = None, files: list[str] | None = None
) -> tuple[np.ndarray, list[str]]:
    """(int32 [m, prompt_tokens], their files): the first `prompt_tokens` ids of the first m <= n held-out files,
    in sorted file order, that have at least that many tokens."""
    root = root or stdlib_root()
    held = split_files(sorted(stdlib_files(root) if files is None else files))[1]
    rows, names = [], []
    for f, ids in zip(held, encode_texts(tok, read_texts(held, root))):
        if len(rows) < n and len(ids) >= prompt_tokens:
            rows.append(ids[:prompt_tokens])
            names.append(f)
    return np.stack(rows) if rows else np.zeros((0, prompt_tokens), np.int32), names


def refuse_nonempty(out: str, overwrite: bool) -> None:
    """One-line error and exit 2 when `out` is a non-empty directory and --overwrite was not given."""
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        log(f"error: --out {out} exists and is not empty (pass --overwrite to rewrite its files)")
        sys.exit(2)


def corpus_files(root: str | None, any_python: bool) -> list[str]:
    """The scanned file list, checked against the committed one unless `any_python` (CLI: one-line error, exit 2)."""
    files = stdlib_files(root)
    if not any_python and FILE_LIST.is_file():
        try:
            check_committed(files)
        except CorpusError as e:
            log(f"error: {e} (pass --any-python to use this interpreter's list)")
            sys.exit(2)
    return files


def write_token_arrays(tok, out: str, files: list[str], root: str | None = None, n_prompts: int = 64) -> dict:
    """out/train.npy, out/heldout.npy (int32, [EOS] after each file), out/heldout_prompts.npy (int32 [m, 256]) and
    out/data_manifest.json; returns the manifest."""
    root = root or stdlib_root()
    t0 = time.time()
    os.makedirs(out, exist_ok=True)
    manifest = corpus_manifest(root, files)
    for split, names in zip(("train", "heldout"), split_files(files)):
        texts = read_texts(names, root)
        docs = encode_texts(tok, texts)
        arr = join_docs(docs, eos_id(tok))
        np.save(os.path.join(out, f"{split}.npy"), arr)
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        manifest[f"{split}_tokens"] = int(arr.size)
        manifest[f"{split}_tokens_per_byte"] = round((arr.size - len(docs)) / max(n_bytes, 1), 4)
        log(f"{split}: {len(names)} files, {n_bytes:,} bytes -> {arr.size:,} tokens ({time.time() - t0:.1f}s)")
    prompts, prompt_files = heldout_prompts(tok, n_prompts, root=root, files=files)
    np.save(os.path.join(out, "heldout_prompts.npy"), prompts)
    manifest.update(eos_id=eos_id(tok), heldout_prompts=list(prompts.shape), heldout_prompt_files=prompt_files)
    with open(os.path.join(out, "data_manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    log(f"held-out prompts: {prompts.shape[0]} x {prompts.shape[1]} tokens; wrote {out} ({time.time() - t0:.1f}s)")
    return manifest


def main(argv=None) -> None:
    from k26jax.tokenizer import Tokenizer

    parser = argparse.ArgumentParser(prog="python -m k26jax.train.corpus", description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True, help="directory with tiktoken.model + tokenizer_config.json")
    parser.add_argument("--out", required=True, help="new (or empty) directory for the .npy token arrays")
    parser.add_argument("--overwrite", action="store_true", help="rewrite the files of a non-empty --out")
    parser.add_argument("--any-python", action="store_true", help="use this stdlib even if it differs from data/")
    parser.add_argument("--root", help="stdlib directory (default: this interpreter's)")
    args = parser.parse_args(argv)
    refuse_nonempty(args.out, args.overwrite)
    write_token_arrays(Tokenizer(args.tokenizer), args.out, corpus_files(args.root, args.any_python), args.root)


if __name__ == "__main__":
    main()
