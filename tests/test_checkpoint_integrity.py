"""Loading a converted checkpoint checks what it reads: an altered, missing, short or long chunk file is refused
with one message naming the leaf and the file; verify=False skips the sha256 (not the size checks); the old
per-leaf manifest still loads and is still checked; only the chunks a process reads are checked; progress goes to
stderr; a directory that is not a checkpoint is told what it lacks."""

import hashlib
import json
import logging
import os
import shutil

import numpy as np
import pytest

from convert import converter
from k26jax import checkpoint, hf_files
from k26jax import hf as hf_layout
from k26jax.api import load
from k26jax.config import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "checkpoints", "tiny")
LEAF, CHUNK = "moe.attn.w_uv", "1.3.0.0"  # layer 1 of the MoE stack, shard 3 of 8


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "tiny_orbax"
    converter.convert(converter.Options(hf_dir=TINY, out=str(out), progress=False), log=lambda s: None)
    return str(out)


@pytest.fixture(scope="module")
def hf_flat():
    return checkpoint.flatten_tree(hf_layout.read_target(TINY, ModelConfig.from_hf_dir(TINY)))


@pytest.fixture
def ckpt(tmp_path, converted):
    shutil.copytree(converted, tmp_path / "c")
    return str(tmp_path / "c")


def _chunk(ckpt, leaf=LEAF, chunk=CHUNK):
    return os.path.join(ckpt, "params", leaf, chunk)


def _flip_a_byte(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x5A
    open(path, "wb").write(bytes(data))


def _assert_one_message(err, *parts):
    text = str(err.value)
    assert "\n" not in text and len(text) < 400, text
    for part in parts:
        assert part in text, text


def test_corrupted_chunk_is_refused_naming_leaf_and_file(ckpt, capfd):
    _flip_a_byte(_chunk(ckpt))  # same size: only the sha256 can tell
    with pytest.raises(checkpoint.CorruptCheckpointError) as err:
        load(ckpt)
    _assert_one_message(err, f"leaf {LEAF}", _chunk(ckpt), "corrupted", "sha256")
    assert "Traceback" not in capfd.readouterr().err


def test_corrupted_drafter_chunk_is_refused(ckpt):
    params = os.path.join(ckpt, "drafter", "params")
    leaf = sorted(f for f in os.listdir(params) if not f.startswith("_"))[0]
    chunk = sorted(f for f in os.listdir(os.path.join(params, leaf)) if not f.startswith("."))[0]
    _flip_a_byte(os.path.join(params, leaf, chunk))
    with pytest.raises(checkpoint.CorruptCheckpointError) as err:
        checkpoint.restore_drafter(os.path.join(ckpt, "drafter"))
    _assert_one_message(err, f"leaf {leaf}", os.path.join(params, leaf, chunk))


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("damage, said", [("missing", "missing"), ("truncated", "truncated"), ("longer", "too long")])
def test_missing_truncated_or_long_chunk_is_one_message(ckpt, capfd, damage, said, verify):
    path = _chunk(ckpt)
    size = os.path.getsize(path)
    if damage == "missing":
        os.remove(path)
    elif damage == "truncated":
        os.truncate(path, size - 10)
    else:
        open(path, "ab").write(b"\0")
    with pytest.raises(checkpoint.CorruptCheckpointError) as err:
        checkpoint.restore(ckpt, verify=verify)
    _assert_one_message(err, f"leaf {LEAF}", path, said)
    noise = capfd.readouterr().err
    assert "TensorStore" not in noise and "asyncio" not in noise, noise


def test_verify_false_skips_the_check(ckpt, hf_flat, caplog):
    _flip_a_byte(_chunk(ckpt))
    with caplog.at_level(logging.INFO, logger="k26jax.checkpoint"):
        model = load(ckpt, verify=False, drafter=False)
    assert "not verified (verify=False)" in caplog.text
    got = np.asarray(model.params["moe"]["attn"]["w_uv"]).view(np.uint8)
    assert not np.array_equal(got, hf_flat[LEAF].view(np.uint8))  # the altered bytes were loaded as they are


def test_verify_logs_the_chunks_and_the_rate(converted, caplog):
    files = sum(len(leaf["chunk_sha256"]) for leaf in checkpoint.read_manifest(converted)["leaves"].values())
    with caplog.at_level(logging.INFO, logger="k26jax.checkpoint"):
        checkpoint.restore(converted)
    assert f"sha256 verified for {files} chunk files" in caplog.text and "MB/s" in caplog.text


def test_only_the_chunks_a_process_reads_are_verified(ckpt, converted):
    """A process whose devices hold layer 0 of the leaf reads and checks layer 0's chunks only."""
    _flip_a_byte(_chunk(ckpt))  # in layer 1
    entry = checkpoint.read_manifest(ckpt)["leaves"][LEAF]
    shape, chunks = tuple(entry["shape"]), tuple(entry["chunks"])
    leaf = checkpoint._Leaf(ckpt, LEAF, shape, chunks, checkpoint.np_dtype(entry["dtype"]), entry["chunk_sha256"])
    layer0 = ((0, 1),) + tuple((0, d) for d in shape[1:])
    with checkpoint.concurrent.futures.ThreadPoolExecutor() as pool:
        stats = checkpoint._Stats(bar=type("Bar", (), {"update": lambda self, n: None})())
        leaf.read(layer0, pool, stats)
        assert stats.verified == {(LEAF, checkpoint.chunk_key((0, s, 0, 0))) for s in range(shape[1] // chunks[1])}
        with pytest.raises(checkpoint.CorruptCheckpointError, match=CHUNK):
            leaf.read(((1, 2),) + layer0[1:], pool, stats)


def _to_old_form(ckpt, hf_flat):
    """Rewrites the manifest as format k26jax-orbax-1 wrote it: one sha256 of each whole leaf's C-order bytes."""
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    manifest["format"] = checkpoint.FORMAT_V1
    for name, leaf in manifest["leaves"].items():
        del leaf["chunk_sha256"]
        leaf["sha256"] = hashlib.sha256(np.ascontiguousarray(hf_flat[name]).view(np.uint8)).hexdigest()
    raw = json.dumps(manifest, indent=1).encode()
    with open(os.path.join(ckpt, "manifest.json"), "wb") as f:
        f.write(raw)
    with open(os.path.join(ckpt, "COMPLETE"), "w") as f:
        json.dump({"format": checkpoint.FORMAT_V1, "manifest_sha256": hashlib.sha256(raw).hexdigest()}, f)


def test_old_form_manifest_still_loads_and_is_checked(ckpt, hf_flat, caplog):
    _to_old_form(ckpt, hf_flat)
    with caplog.at_level(logging.INFO, logger="k26jax.checkpoint"):
        _, params = checkpoint.restore(ckpt, dtype=None)
    assert "whole-leaf sha256 verified" in caplog.text and "reconverting" in caplog.text
    got = checkpoint.flatten_tree(params)
    assert all(np.array_equal(np.asarray(got[n]).view(np.uint8), hf_flat[n].view(np.uint8)) for n in hf_flat)
    _flip_a_byte(_chunk(ckpt))
    with pytest.raises(checkpoint.CorruptCheckpointError) as err:
        checkpoint.restore(ckpt)
    _assert_one_message(err, f"leaf {LEAF}", "corrupted")
    checkpoint.restore(ckpt, verify=False)


def test_progress_goes_to_stderr(converted, capsys):
    checkpoint.restore(converted, progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "load target (verify)" in err and "B/s" in err


def _refusal(path):
    with pytest.raises(checkpoint.IncompleteCheckpointError) as err:
        load(path)
    text = str(err.value)
    assert "--resume" not in text and "model.safetensors.index.json" in text and "python -m convert" in text, text
    return text


def test_not_a_checkpoint_says_what_it_lacks(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "the directory is empty" in _refusal(tmp_path / "empty")
    hf = tmp_path / "hf"
    shutil.copytree(TINY, hf, ignore=shutil.ignore_patterns("drafter", hf_files.INDEX_FILE))
    assert f"no {hf_files.INDEX_FILE}" in _refusal(hf)
    for f in os.listdir(hf):
        if f.endswith(".safetensors"):
            os.remove(hf / f)
    assert "config.json but no weights" in _refusal(hf)


def test_zarr_metadata_that_differs_from_the_manifest_is_refused(ckpt):
    """The chunk files are read raw, so a .zarray describing another encoding (here: compressed) is refused."""
    path = os.path.join(ckpt, "params", LEAF, ".zarray")
    with open(path) as f:
        meta = json.load(f)
    meta["compressor"] = {"id": "zstd", "level": 3}
    with open(path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(checkpoint.CorruptCheckpointError) as err:
        checkpoint.restore(ckpt, verify=False)
    _assert_one_message(err, f"leaf {LEAF}", path, "compressor")
