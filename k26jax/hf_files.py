"""The files of a Hugging Face safetensors checkpoint directory: reading its shards through the index, writing
shards and an index. The K2 layout on top (names, shapes, relayouts) is k26jax/hf.py.

Names: K2.5/K2.6 files prefix the text model with `language_model.` (stripped on read) and carry `vision_tower.*` /
`mm_projector.*` tensors (skipped and counted); K2 / K2-Thinking have no prefix; `rotary_emb.inv_freq` buffers are
skipped. Shards are found through `model.safetensors.index.json` (or a lone `model.safetensors`), never by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterable
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WRAPPER_PREFIX = "language_model."
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
SKIPPED_SUFFIXES = (".rotary_emb.inv_freq",)
_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}  # safetensors dtype tag -> bytes


class CheckpointError(ValueError):
    """A checkpoint directory that does not hold what its config implies."""


class HFCheckpoint:
    """The tensors of a HF checkpoint directory by canonical name (`model.layers.3.mlp.gate.weight`, `lm_head.weight`).

    Headers are parsed up front (shape, dtype, and a truncation check per shard); data is read one tensor (or row
    block) at a time through memory-mapped `safe_open` handles, which `release()` unmaps.
    """

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = os.fspath(hf_dir)
        self.entries: dict[str, dict[str, Any]] = {}  # name -> {file, disk_name, shape, dtype, nbytes, offset}
        self.skipped: dict[str, list[int]] = {}  # skipped group -> [tensors, bytes]
        self._handles: dict[str, Any] = {}
        weight_map = self._weight_map()
        headers = {
            f: self._header(f, sorted(n for n, g in weight_map.items() if g == f))
            for f in sorted(set(weight_map.values()))
        }
        for disk_name, file in weight_map.items():
            header, data_start = headers[file]
            info = header.get(disk_name)
            if info is None:
                raise CheckpointError(
                    f"{self._path(file)}: {INDEX_FILE} lists tensor {disk_name!r} in this shard, "
                    f"but the shard does not contain it"
                )
            dtype, shape = info["dtype"], tuple(info["shape"])
            nbytes = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE.get(dtype, 1)
            name = disk_name[len(WRAPPER_PREFIX) :] if disk_name.startswith(WRAPPER_PREFIX) else disk_name
            group = next((p.rstrip(".") for p in SKIPPED_PREFIXES if name.startswith(p)), None)
            group = group or next((s.lstrip(".") for s in SKIPPED_SUFFIXES if name.endswith(s)), None)
            if group:
                count = self.skipped.setdefault(group, [0, 0])
                count[0], count[1] = count[0] + 1, count[1] + nbytes
                continue
            if name in self.entries:
                raise CheckpointError(
                    f"{self._path(file)}: tensor {disk_name!r} maps to {name!r}, which "
                    f"{self.entries[name]['disk_name']!r} in {self.entries[name]['file']} also does"
                )
            self.entries[name] = dict(
                file=file,
                disk_name=disk_name,
                shape=shape,
                dtype=dtype,
                nbytes=nbytes,
                offset=data_start + info["data_offsets"][0],
            )

    # ---- index and headers --------------------------------------------------------------------------------
    def _path(self, file: str) -> str:
        return os.path.join(self.dir, file)

    def _weight_map(self) -> dict[str, str]:
        index_path = self._path(INDEX_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: not a safetensors index with a 'weight_map' ({e!r})") from e
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path}: 'weight_map' is empty or not an object")
            return weight_map
        if os.path.isfile(self._path(SINGLE_FILE)):
            return {name: SINGLE_FILE for name in _read_header(self._path(SINGLE_FILE))[0]}
        raise CheckpointError(f"{self.dir}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")

    def _header(self, file: str, names: list[str]) -> tuple[dict[str, Any], int]:
        path = self._path(file)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"{path}: shard is missing; {INDEX_FILE} maps {len(names)} tensor(s) to it, e.g. {names[0]!r}"
            )
        return _read_header(path)

    # ---- reading ------------------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def _handle(self, name: str):
        entry = self.entries[name]
        if entry["file"] not in self._handles:
            self._handles[entry["file"]] = safe_open(self._path(entry["file"]), framework="numpy")
        return self._handles[entry["file"]], entry["disk_name"]

    def read(self, name: str) -> np.ndarray:
        """The whole tensor, copied out of the mapped shard."""
        handle, disk_name = self._handle(name)
        return handle.get_tensor(disk_name)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor (leading axis), reading only those bytes."""
        handle, disk_name = self._handle(name)
        return handle.get_slice(disk_name)[start:stop]

    def read_columns(self, name: str, start: int, stop: int) -> np.ndarray:
        """Columns [start, stop) of a 2-D tensor (strided read of the mapped shard)."""
        handle, disk_name = self._handle(name)
        return handle.get_slice(disk_name)[:, start:stop]

    def prefetch(self, prefix: str) -> None:
        """Asks the OS to start reading every tensor whose name starts with `prefix` (POSIX_FADV_WILLNEED), so the
        disk works ahead while the current layer is assembled."""
        by_file: dict[str, list[tuple[int, int]]] = {}
        for name, entry in self.entries.items():
            if name.startswith(prefix):
                by_file.setdefault(entry["file"], []).append((entry["offset"], entry["nbytes"]))
        for file, ranges in by_file.items():
            fd = os.open(self._path(file), os.O_RDONLY)
            try:
                for offset, nbytes in ranges:
                    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def release(self) -> None:
        """Unmaps the shards opened so far (mapped pages count towards resident memory)."""
        self._handles.clear()

    def skipped_summary(self) -> str:
        return ", ".join(f"{group}: {n} tensors, {b / 1e6:.1f} MB" for group, (n, b) in sorted(self.skipped.items()))

    def where(self, name: str) -> str:
        entry = self.entries[name]
        return f"{entry['file']}: {entry['disk_name']}"


def _read_header(path: str) -> tuple[dict[str, Any], int]:
    """(tensor name -> {dtype, shape, data_offsets}, byte offset of the data) from a safetensors file, which must
    hold every byte its header names."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(f"{path}: shard is truncated (shorter than the 8-byte header length)")
        (header_len,) = struct.unpack("<Q", raw_len)
        raw = f.read(header_len)
    if len(raw) < header_len:
        raise CheckpointError(f"{path}: shard is truncated inside its {header_len}-byte header")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from e
    header.pop("__metadata__", None)
    try:
        data_end = max((max(v["data_offsets"]) for v in header.values()), default=0)
    except (TypeError, KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (a header entry has no data_offsets: {e})") from e
    size = os.path.getsize(path)
    if size < 8 + header_len + data_end:
        raise CheckpointError(
            f"{path}: shard is truncated: its header needs {8 + header_len + data_end} bytes, the file has {size}"
        )
    return header, 8 + header_len


class TensorFiles:
    """The tensors of a safetensors directory by name (index or single file), each checked against its expected
    shape when read: the lighter reader of drafter checkpoints."""

    def __init__(self, path: str, expected: dict[str, tuple[int, ...]], stack: contextlib.ExitStack):
        self.files, self.expected, self.stack, self.opened = _tensor_files(path), expected, stack, {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str) -> np.ndarray:
        file = self.files[name]
        if file not in self.opened:
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{file}: listed for tensor {name!r} but missing")
            _read_header(file)  # a truncated or foreign file gets its own error, not safetensors'
            self.opened[file] = self.stack.enter_context(safe_open(file, framework="np"))
        w = self.opened[file].get_tensor(name)
        if w.shape != self.expected[name]:
            raise ValueError(f"{file}: tensor {name!r} has shape {w.shape}, expected {self.expected[name]}")
        return w

    def release(self) -> None:
        pass


def check_tensor_files(path: str) -> None:
    """Every safetensors file of a (drafter) directory is present and holds the bytes its header names: checked
    before a conversion writes anything."""
    for file in sorted(set(_tensor_files(path).values())):
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: listed in {os.path.join(path, INDEX_FILE)} but missing")
        _read_header(file)


def _tensor_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index when the checkpoint is sharded."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE}")
    return {name: single for name in _read_header(single)[0]}


def write_shards(
    out: str, tensors: Iterable[tuple[str, np.ndarray]], shard_bytes: int, split_after: str | None = None
) -> list[str]:
    """Writes `model-0000i-of-00000n.safetensors` shards of at most `shard_bytes` (a larger tensor gets its own)
    and their index, holding one shard in memory; a shard also ends after the tensor `split_after`. Returns the
    shard file names."""
    current: dict[str, np.ndarray] = {}
    size, tmp_names = 0, []

    def flush():
        nonlocal current, size
        name = f"shard-{len(tmp_names)}.tmp"
        save_file(current, os.path.join(out, name), metadata={"format": "pt"})
        tmp_names.append((name, list(current)))
        current, size = {}, 0

    for name, arr in tensors:
        if current and size + arr.nbytes > shard_bytes:
            flush()
        current[name] = arr
        size += arr.nbytes
        if name == split_after:
            flush()
    if current:
        flush()
    weight_map, files = {}, []
    for i, (tmp, names) in enumerate(tmp_names):
        final = f"model-{i + 1:05d}-of-{len(tmp_names):06d}.safetensors"  # K2.5's six-digit total
        os.replace(os.path.join(out, tmp), os.path.join(out, final))
        files.append(final)
        weight_map.update({n: final for n in names})
    total = sum(os.path.getsize(os.path.join(out, final)) for final in files)
    dump_json(os.path.join(out, INDEX_FILE), {"metadata": {"total_size": total}, "weight_map": weight_map})
    return files


def dump_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
