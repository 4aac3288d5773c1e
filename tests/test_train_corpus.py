"""k26jax.train.corpus: the stdlib file list, the held-out rule, reading, token arrays and random windows."""

import hashlib
import platform

import numpy as np
import pytest

from k26jax.train import corpus


def test_heldout_bucket_hand_computed():
    # digests from coreutils `printf %s PATH | sha256sum`, residues from `bc` (ibase=16; HEX % A)
    cases = {
        "ast.py": ("b4fa779c3f4350605d64993638c18a07798d0c248a79259bdb23e3c18adcc05a", 0),
        "os.py": ("d9d7c69c64b6688cd177d27d06600607f7660063b7fb146f9f379c30f9c3fe4f", 3),
    }
    for path, (hexdigest, bucket) in cases.items():
        assert hashlib.sha256(path.encode()).hexdigest() == hexdigest
        assert corpus.is_heldout(path) == (bucket == 0)


def test_heldout_fraction_near_one_tenth():
    paths = [f"pkg{i}/mod{i}.py" for i in range(5000)]
    held = corpus.split_files(paths)[1]
    assert 400 < len(held) < 600
    assert all(corpus.is_heldout(p) for p in held)


def _touch(root, rel, data=b"x = 1\n"):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_stdlib_files_exclusions(tmp_path):
    kept = ["a.py", "pkg/b.py", "pkg/testing.py", "z/test_x.py", "contest/i.py", "pkg/sub/j.py"]
    dropped = [
        "test/d.py",
        "tests/e.py",
        "idlelib/f.py",
        "site-packages/g.py",
        "pkg/test/c.py",
        "pkg/tests/h.py",
        "pkg/sub/idlelib/k.py",
        "pkg/notes.txt",
        "pkg/mod.pyc",
    ]
    for rel in kept + dropped:
        _touch(tmp_path, rel)
    assert corpus.stdlib_files(str(tmp_path)) == sorted(kept)


def test_committed_list_matches_this_stdlib():
    committed = corpus.read_file_list()
    with open(corpus.FILE_LIST) as f:
        header = f.readline()
    assert header.startswith("# Python 3.12.1 ") and corpus.file_list_hash(committed) in header
    assert committed == sorted(committed) and len(committed) > 500
    assert not any(set(p.split("/")[:-1]) & set(corpus.EXCLUDED_DIRS) for p in committed)
    with open(corpus.FILE_LIST) as f:
        marks = dict(line.rstrip("\n").split("\t") for line in f if not line.startswith("#"))
    assert all((marks[p] == "heldout") == corpus.is_heldout(p) for p in committed)
    if platform.python_version() != "3.12.1":
        pytest.skip("the committed list is this repo's Python 3.12.1 stdlib")
    assert corpus.stdlib_files() == committed
    corpus.check_committed(committed)
    with pytest.raises(corpus.CorpusError, match="1 missing"):
        corpus.check_committed(committed[1:])


def test_file_list_hash_is_of_the_ordered_lines():
    assert corpus.file_list_hash(["a.py", "b/c.py"]) == hashlib.sha256(b"a.py\nb/c.py\n").hexdigest()
    assert corpus.file_list_hash(["a.py", "b/c.py"]) != corpus.file_list_hash(["b/c.py", "a.py"])


def test_read_texts_exact_and_refuses_undecodable(tmp_path):
    _touch(tmp_path, "ok.py", "s = 'Café'\r\n".encode())
    _touch(tmp_path, "bad1.py", "s = 'Café'\n".encode("latin-1"))
    _touch(tmp_path, "pkg/bad2.py", b"\xff\n")
    assert corpus.read_texts(["ok.py"], str(tmp_path)) == ["s = 'Café'\r\n"]
    with pytest.raises(corpus.CorpusError, match=r"2 corpus file.*bad1\.py.*pkg/bad2\.py"):
        corpus.read_texts(["ok.py", "bad1.py", "pkg/bad2.py"], str(tmp_path))


def test_manifest_counts(tmp_path):
    for rel in ("ast.py", "os.py", "pkg/m.py"):
        _touch(tmp_path, rel, rel.encode() * 3)
    m = corpus.corpus_manifest(str(tmp_path))
    assert (m["num_files"], m["num_heldout_files"], m["num_train_files"]) == (3, 1, 2)
    assert (m["heldout_bytes"], m["train_bytes"]) == (18, 15 + 24)
    assert m["file_list_sha256"] == corpus.file_list_hash(["ast.py", "os.py", "pkg/m.py"])
    assert m["python_version"] == platform.python_version()


def test_join_docs_puts_eos_after_each_file():
    docs = [np.array([5, 6], np.int32), np.array([], np.int32), np.array([7], np.int32)]
    out = corpus.join_docs(docs, 99)
    assert out.dtype == np.int32 and out.tolist() == [5, 6, 99, 99, 7, 99]


def test_batches_deterministic_windows():
    tokens = np.arange(1000, dtype=np.int32)
    a, b, c = (corpus.batches(tokens, 16, 4, seed) for seed in (7, 7, 8))
    xs = [next(a) for _ in range(3)]
    assert all(np.array_equal(x, next(b)) for x in xs)
    assert not np.array_equal(xs[0], next(c))
    for x in xs:
        assert x.shape == (4, 16) and x.dtype == np.int32
        assert (np.diff(x, axis=1) == 1).all() and x.min() >= 0 and x.max() < 1000
    with pytest.raises(ValueError, match="shorter"):
        next(corpus.batches(tokens[:8], 16, 4, 0))


def test_cli_refuses_nonempty_out(tmp_path, capsys):
    (tmp_path / "keep").write_text("x")
    with pytest.raises(SystemExit) as e:
        corpus.main(["--tokenizer", str(tmp_path), "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not empty" in err and "--overwrite" in err
