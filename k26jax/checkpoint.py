"""Restoring checkpoints written by `python -m convert` straight onto a mesh, verifying what is read.

A converted directory holds:
  params/         an orbax PyTree checkpoint: one zarr v2 array per leaf, uncompressed, chunked per layer and shard;
                  chunk (i, j, ...) of leaf "a.b.c" is the file params/a.b.c/i.j... (dimension separator ".")
  manifest.json   the source config ("hf_config", "generation_config"), conversion options, and per leaf: shape,
                  dtype, chunk shape and "chunk_sha256" {chunk file name: sha256 of the file}. The files hold the
                  chunk's array bytes in C order, nothing else, so that hash is also the hash of those bytes.
                  Format k26jax-orbax-1 (still read) held one "sha256" per whole leaf, of its C-order bytes instead.
  COMPLETE        written last; holds the manifest's sha256. Without it the directory is not a checkpoint.
  drafter/        optionally the DFlash drafter, with the same layout
The target's directory also carries the source config.json, generation_config.json and tokenizer files.

`restore` reads, for each leaf, the chunk files that this process's devices hold (its addressable shards), each
once, in a thread pool, and checks each against its sha256 as it reads it (hashlib and file reads release the GIL),
so verifying costs no second pass over the disk, and on several hosts each process checks exactly its own chunks. A
missing, short or altered file stops the load with one message naming the leaf and the file. Any mesh works whose
axes divide the shapes (sharding.fit_spec replicates dims they do not); a shard may span or cut chunks (a chunk cut
by two shards is read once for each). `last_read` says what this process's latest restore read, in bytes and files.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import threading
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from k26jax import sharding
from k26jax.config import DrafterConfig, ModelConfig
from k26jax.model import params as param_table
from k26jax.model.params import drafter_table, target_table

FORMAT = "k26jax-orbax-2"  # per-chunk sha256
FORMAT_V1 = "k26jax-orbax-1"  # per-leaf sha256
READABLE_FORMATS = (FORMAT, FORMAT_V1)
PARAMS_DIR, MANIFEST_FILE, COMPLETE_FILE = "params", "manifest.json", "COMPLETE"
DRAFTER_DIR = "drafter"
DTYPES = {"bfloat16": jax.numpy.bfloat16, "float32": np.float32}
ZARR_DTYPES = {"bfloat16": "bfloat16", "float32": "<f4", "int32": "<i4", "float16": "<f2"}
ACCEPTED = (
    "k26jax loads a Hugging Face checkpoint (config.json with model.safetensors.index.json and the shards it "
    "lists, or config.json with one model.safetensors) or a directory made by `python -m convert` "
    f"({PARAMS_DIR}/, {MANIFEST_FILE}, {COMPLETE_FILE})"
)
STAGING_FILES = ("plan.json", "journal.jsonl")  # what the converter's OUT.partial holds
log = logging.getLogger(__name__)


class IncompleteCheckpointError(ValueError):
    """A directory that is not a complete converted checkpoint (e.g. an interrupted conversion)."""


class CorruptCheckpointError(ValueError):
    """A chunk file that is missing, of the wrong size, unreadable, or not the bytes the manifest's sha256 names."""


# ---- the chunk grid (shared with the converter) ------------------------------------------------------------
def chunk_key(index: tuple[int, ...]) -> str:
    """The file name of chunk `index` in a zarr v2 array ("." separated; "0" for a 0-d array)."""
    return ".".join(map(str, index)) or "0"


def chunks_in(region: tuple[tuple[int, int], ...], chunks) -> list[tuple[int, ...]]:
    """Grid indices of the chunks that intersect region ((start, stop) per dim), in C order."""
    return list(itertools.product(*(range(a // c, -(-b // c)) for (a, b), c in zip(region, chunks))))


def all_chunk_keys(shape, chunks) -> list[str]:
    return [chunk_key(g) for g in chunks_in(tuple((0, d) for d in shape), chunks)]


def np_dtype(name: str) -> np.dtype:
    return np.dtype(jax.numpy.bfloat16) if name == "bfloat16" else np.dtype(name)


# ---- the directory and its manifest -----------------------------------------------------------------------
def describe_dir(path: str) -> str:
    """Why `path` is not a checkpoint k26jax can load: what it holds, what it lacks, what is accepted."""
    names = set(os.listdir(path))
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    if not names:
        what = "the directory is empty"
    elif set(STAGING_FILES) & names or path.endswith(".partial"):
        what = (
            "it is a conversion that has not finished (no COMPLETE marker); finish it by rerunning "
            "`python -m convert` with the same arguments and --resume, and load the --out directory"
        )
    elif MANIFEST_FILE in names or PARAMS_DIR in names:
        what = f"it has {MANIFEST_FILE} or {PARAMS_DIR}/ but no {COMPLETE_FILE} marker: an unfinished or damaged copy"
    elif shards:
        index = "model.safetensors" if "model.safetensors" in names else "model.safetensors.index.json"
        lacks = [n for n in ("config.json", index) if n not in names]
        what = (
            f"it has {len(shards)} .safetensors file(s) ({shards[0]}, ...) but no {' and no '.join(lacks)}"
            if lacks
            else "it is a Hugging Face checkpoint, which k26jax.load reads (or `python -m convert` converts)"
        )
    elif "config.json" in names:
        what = "it has config.json but no weights (no .safetensors files, no params/)"
    else:
        what = (
            f"it holds neither weights nor a config ({', '.join(sorted(names)[:5])}{', ...' if len(names) > 5 else ''})"
        )
    return f"{path}: not a converted checkpoint: {what}. {ACCEPTED}"


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a complete checkpoint; IncompleteCheckpointError (naming what is wrong) otherwise."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise IncompleteCheckpointError(f"{path}: no such directory")
    marker = os.path.join(path, COMPLETE_FILE)
    if not os.path.isfile(marker):
        raise IncompleteCheckpointError(describe_dir(path))
    try:
        with open(marker) as f:
            done = json.load(f)
        with open(os.path.join(path, MANIFEST_FILE), "rb") as f:
            raw = f.read()
    except (OSError, json.JSONDecodeError) as e:
        raise IncompleteCheckpointError(f"{path}: unreadable {COMPLETE_FILE} or {MANIFEST_FILE} ({e})") from e
    if not isinstance(done, dict) or done.get("format") not in READABLE_FORMATS:
        got = done.get("format") if isinstance(done, dict) else done
        raise IncompleteCheckpointError(f"{path}: format {got!r}; this k26jax reads {READABLE_FORMATS}")
    if done.get("manifest_sha256") != hashlib.sha256(raw).hexdigest():
        raise IncompleteCheckpointError(
            f"{path}: {MANIFEST_FILE} does not match the {COMPLETE_FILE} marker: the checkpoint was altered or "
            f"copied incompletely"
        )
    return json.loads(raw)


# ---- reading leaves ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Leaf:
    ckpt: str
    name: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype
    sha256: dict[str, str] | None  # chunk key -> hex digest, when verifying chunk by chunk

    @property
    def dir(self) -> str:
        return os.path.join(self.ckpt, PARAMS_DIR, self.name)

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.chunks) * self.dtype.itemsize

    def fail(self, file: str, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.ckpt}: leaf {self.name}: {file}: {what}. The checkpoint is damaged: copy it again or reconvert it"
        )

    def check_zarray(self) -> None:
        """The zarr metadata must describe what the manifest does, or the raw chunk reads below would misread."""
        path = os.path.join(self.dir, ".zarray")
        try:
            with open(path) as f:
                meta = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise self.fail(path, f"unreadable ({e})") from e
        want = {
            "shape": list(self.shape),
            "chunks": list(self.chunks),
            "dtype": ZARR_DTYPES.get(str(self.dtype)),
            "compressor": None,
            "filters": None,
            "order": "C",
            "dimension_separator": ".",
        }
        meta.setdefault("dimension_separator", ".")
        bad = {k: meta.get(k) for k, v in want.items() if meta.get(k) != v}
        if bad:
            implied = {k: want[k] for k in bad}
            raise self.fail(path, f"{bad} where the manifest implies {implied}")

    def read_chunk(self, index: tuple[int, ...], stats: _Stats, into: np.ndarray | None = None) -> np.ndarray:
        """One chunk file as a chunk-shaped array (read into `into`, a C-contiguous chunk-shaped array, if given),
        checked against its sha256 the first time it is read."""
        key = chunk_key(index)
        path = os.path.join(self.dir, key)
        buf = np.empty(self.chunk_bytes, np.uint8) if into is None else into.reshape(-1).view(np.uint8)
        try:
            with open(path, "rb", buffering=0) as f:
                size, view = 0, memoryview(buf)
                while size < len(buf) and (n := f.readinto(view[size:])):
                    size += n
                longer = f.read(1)
        except FileNotFoundError:
            raise self.fail(path, "missing") from None
        except OSError as e:
            raise self.fail(path, f"unreadable ({e.strerror or e})") from e
        if size < len(buf) or longer:
            got = f"{size}" if not longer else f"more than {len(buf)}"
            raise self.fail(path, f"{'truncated' if not longer else 'too long'}: {got} bytes, expected {len(buf)}")
        if self.sha256 is not None and (self.name, key) not in stats.verified:
            want, got = self.sha256.get(key), hashlib.sha256(buf).hexdigest()
            if got != want:
                raise self.fail(path, f"corrupted: its sha256 is {got[:16]}..., the manifest's {str(want)[:16]}...")
            stats.verified.add((self.name, key))
        stats.progress(len(buf), (self.name, key))
        return buf.view(self.dtype).reshape(self.chunks)

    def read(self, region: tuple[tuple[int, int], ...], pool, stats: _Stats) -> np.ndarray:
        """leaf[region] (region: (start, stop) per dim) from its chunk files, read in parallel."""
        out = np.empty(tuple(b - a for a, b in region), self.dtype)

        def copy(index):
            dst, src = [], []
            for (a, b), i, c in zip(region, index, self.chunks):
                lo, hi = max(a, i * c), min(b, i * c + c)
                dst.append(slice(lo - a, hi - a))
                src.append(slice(lo - i * c, hi - i * c))
            target = out[tuple(dst)]
            if target.shape == self.chunks and target.flags.c_contiguous:  # the whole chunk, in one run of `out`
                self.read_chunk(index, stats, into=target)
            else:
                target[...] = self.read_chunk(index, stats)[tuple(src)]

        futures = [pool.submit(copy, index) for index in chunks_in(region, self.chunks)]
        try:
            for f in futures:
                f.result()
        finally:
            for f in futures:
                f.cancel()
        return out


@dataclasses.dataclass
class _Stats:
    bar: object  # tqdm, advanced by every chunk file's bytes
    verified: set = dataclasses.field(default_factory=set)  # (leaf, chunk key) checked so far
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    bytes_read: int = 0  # every file read counts, a chunk read twice twice
    file_reads: int = 0
    chunks: dict = dataclasses.field(default_factory=dict)  # (leaf, chunk key) -> its bytes, each chunk once

    def progress(self, nbytes: int, chunk: tuple[str, str] | None = None) -> None:
        with self.lock:
            self.bar.update(nbytes)
            self.bytes_read += nbytes
            self.file_reads += 1
            if chunk is not None:
                self.chunks[chunk] = nbytes


@dataclasses.dataclass(frozen=True)
class ReadStats:
    """What one restore read in this process (`last_read`): every chunk-file read in bytes and files (a chunk that
    two of the process's shards cut is read twice), the distinct chunk files and their bytes, how many were checked
    against their sha256, and the seconds. On several hosts each process reports its own share."""

    path: str
    kind: str  # "target" | "drafter"
    process_index: int
    bytes_read: int
    file_reads: int
    chunk_files: int
    chunk_bytes: int
    verified: int
    seconds: float


_LAST_READ: dict[str, ReadStats] = {}


def last_read(kind: str = "target") -> ReadStats | None:
    """The ReadStats of this process's latest restore of a `kind` checkpoint ("target" | "drafter"), or None."""
    return _LAST_READ.get(kind)


def _region(index: tuple, shape) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(d)[:2] for s, d in zip(index, shape))


def _restore_tree(
    path: str, manifest: dict, shardings: dict, dtype: str | None, table: dict, verify: bool, progress: bool | None
) -> dict:
    """Restores manifest['leaves'] (flat "a.b.c" names) into a nested dict of jax arrays; float leaves are cast to
    `dtype` except those of a fixed dtype in the parameter table (bf16 expert scales, the fp32 router bias)."""
    fixed = {".".join(p) for p in param_table.fixed_dtype_leaves(table)}
    per_chunk = manifest.get("format", FORMAT) != FORMAT_V1
    leaves, reads = _plan_reads(path, manifest, shardings, verify and per_chunk)
    total = sum(len(chunks_in(region, leaf.chunks)) * leaf.chunk_bytes for _, leaf, region, _ in reads)
    mode = "verify" if verify and per_chunk else "no verify" if not verify else "verify leaves"
    kind = "drafter" if manifest.get("kind") == "drafter" else "target"

    def want(name: str, leaf: _Leaf) -> np.dtype:
        castable = jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating) and name not in fixed
        return np.dtype(DTYPES[dtype]) if dtype is not None and castable else leaf.dtype

    with concurrent.futures.ThreadPoolExecutor() as pool, concurrent.futures.ThreadPoolExecutor(1) as ahead:
        if verify and not per_chunk:
            _verify_whole_leaves(leaves, manifest, pool, progress)
        start, tree, shards = time.perf_counter(), {}, {}
        with _bar(total, f"load {kind} ({mode})", progress) as bar:
            stats = _Stats(bar)

            def fetch(k: int):  # region k, read while the one before is copied to its devices
                name, leaf, region, _ = reads[k]
                return leaf.read(region, pool, stats).astype(want(name, leaf), copy=False)

            pending = ahead.submit(fetch, 0) if reads else None
            for k, (name, leaf, _, devices) in enumerate(reads):
                host, pending = pending.result(), ahead.submit(fetch, k + 1) if k + 1 < len(reads) else None
                shards.setdefault(name, []).extend(jax.device_put(host, d) for d in devices)
                if k + 1 == len(reads) or reads[k + 1][0] != name:
                    arr = jax.make_array_from_single_device_arrays(leaf.shape, shardings[name], shards.pop(name))
                    _set(tree, name.split("."), arr)
    seconds = time.perf_counter() - start
    _LAST_READ[kind] = ReadStats(
        path,
        kind,
        jax.process_index(),
        stats.bytes_read,
        stats.file_reads,
        len(stats.chunks),
        sum(stats.chunks.values()),
        len(stats.verified),
        seconds,
    )
    if jax.process_count() > 1:
        log.info(
            "%s: process %d of %d read %d chunk files, %.1f MB (its own shards)",
            path,
            jax.process_index(),
            jax.process_count(),
            len(stats.chunks),
            stats.bytes_read / 1e6,
        )
    rate = f"{total / 1e6:.1f} MB in {seconds:.2f} s ({total / 1e6 / max(seconds, 1e-9):.0f} MB/s)"
    if verify and per_chunk:
        log.info("%s: read %s; sha256 verified for %d chunk files", path, rate, len(stats.verified))
    elif verify:
        log.info("%s: read %s; whole-leaf sha256 verified (format %s)", path, rate, FORMAT_V1)
    else:
        log.info("%s: read %s; not verified (verify=False)", path, rate)
    return tree


def _plan_reads(path: str, manifest: dict, shardings: dict, per_chunk: bool) -> tuple[list[_Leaf], list[tuple]]:
    """The leaves, and (name, leaf, region, devices) for each distinct region this process's devices hold: the
    reads of the load, each region read once for all the devices that hold it."""
    leaves, reads = [], []
    for name, entry in manifest["leaves"].items():
        if per_chunk and not isinstance(entry.get("chunk_sha256"), dict):
            raise IncompleteCheckpointError(f"{path}: {MANIFEST_FILE}: leaf {name} has no chunk_sha256")
        sums = entry["chunk_sha256"] if per_chunk else None
        leaf = _Leaf(path, name, tuple(entry["shape"]), tuple(entry["chunks"]), np_dtype(entry["dtype"]), sums)
        leaf.check_zarray()
        regions = {}
        for device, index in shardings[name].addressable_devices_indices_map(leaf.shape).items():
            regions.setdefault(_region(index, leaf.shape), []).append(device)
        leaves.append(leaf)
        reads += [(name, leaf, region, devices) for region, devices in regions.items()]
    return leaves, reads


def _bar(total: int, desc: str, progress: bool | None):
    """A bytes progress bar on stderr (progress None: only when stderr is a terminal)."""
    from tqdm import tqdm

    disable = None if progress is None else not progress
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=disable, smoothing=0.1)


def _verify_whole_leaves(leaves: list[_Leaf], manifest: dict, pool, progress: bool | None) -> None:
    """Format k26jax-orbax-1: the sha256 of each whole leaf's C-order bytes, read in blocks of chunk rows."""
    log.warning(
        "%s: format %s records one sha256 per whole leaf, so every process reads every whole leaf once more to "
        "check it; reconverting gives per-chunk checks at no extra read",
        leaves[0].ckpt if leaves else "",
        FORMAT_V1,
    )
    total = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves)
    with _bar(total, "verify", progress) as bar:
        stats = _Stats(bar)
        for leaf in leaves:
            hasher = hashlib.sha256()
            blocks = [()]  # a 0-d leaf; else blocks of whole chunk rows, in C order
            if leaf.shape:
                n, rows, rest = leaf.shape[0], leaf.chunks[0], tuple((0, d) for d in leaf.shape[1:])
                blocks = [((r, min(r + rows, n)),) + rest for r in range(0, n, rows)]
            for region in blocks:
                hasher.update(leaf.read(region, pool, stats).view(np.uint8))
            want = manifest["leaves"][leaf.name].get("sha256")
            if hasher.hexdigest() != want:
                raise leaf.fail(
                    leaf.dir,
                    f"corrupted: the leaf's sha256 is not the manifest's (format {FORMAT_V1} cannot tell which file)",
                )


def _set(tree: dict, keys: list[str], value) -> None:
    for key in keys[:-1]:
        tree = tree.setdefault(key, {})
    tree[keys[-1]] = value


def flatten_tree(tree: dict, prefix: str = "") -> dict:
    """Nested dict -> {"a.b.c": leaf} (the names the manifest and the converter use)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten_tree(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _shardings(manifest: dict, specs: dict, mesh: Mesh | None) -> dict:
    specs = flatten_tree(specs)
    missing = sorted(set(manifest["leaves"]) ^ set(specs))
    if missing:
        raise ValueError(f"checkpoint leaves and the parameter tree differ: {missing[:8]}")
    if mesh is None:
        device = SingleDeviceSharding(jax.local_devices()[0])
        return {name: device for name in specs}
    return {
        name: NamedSharding(mesh, sharding.fit_spec(spec, tuple(manifest["leaves"][name]["shape"]), mesh))
        for name, spec in specs.items()
    }


def model_config(manifest: dict) -> ModelConfig:
    """The target config stored in a manifest (config.json, plus generation_config.json's eos ids)."""
    cfg = ModelConfig.from_hf_dict(manifest["hf_config"], source=f"{MANIFEST_FILE}: hf_config")
    gen_eos = (manifest.get("generation_config") or {}).get("eos_token_id")
    gen_eos = () if gen_eos is None else tuple(gen_eos) if isinstance(gen_eos, list) else (gen_eos,)
    return cfg.replace(eos_token_ids=cfg.eos_token_ids + tuple(e for e in gen_eos if e not in cfg.eos_token_ids))


def restore(
    ckpt_dir: str | os.PathLike,
    cfg: ModelConfig | None = None,
    *,
    mesh: Mesh | None = None,
    expert_mode: str = "ep",
    dtype: str | None = "bfloat16",
    verify: bool = True,
    progress: bool | None = None,
) -> tuple[ModelConfig, dict]:
    """(config, parameter tree of jax arrays) from a converted target checkpoint.

    mesh: a ("data", "model") mesh; leaves are placed with NamedSharding(mesh, param_partition_specs(cfg,
    expert_mode)) fitted to their shapes. None: the default device. dtype: float leaves are cast to it on read
    ("bfloat16" | "float32"; None keeps the stored dtype); packed ints, bf16 scales and the fp32 router bias keep
    theirs. cfg: checked against the stored config when given. verify: check every chunk file read against the
    manifest's sha256 (False skips it). progress: a bar on stderr (None: only when stderr is a terminal).
    """
    path = os.fspath(ckpt_dir)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {tuple(DTYPES)} or None")
    manifest = read_manifest(path)
    if manifest.get("kind") != "target":
        raise ValueError(f"{path}: holds a {manifest.get('kind')!r} checkpoint, not a target model")
    stored = model_config(manifest)
    if cfg is not None and cfg != stored:
        diff = [f.name for f in dataclasses.fields(stored) if getattr(cfg, f.name) != getattr(stored, f.name)]
        raise ValueError(f"{path}: cfg differs from the checkpoint's config in {diff}")
    specs = sharding.param_partition_specs(stored, expert_mode)
    shardings = _shardings(manifest, specs, mesh)
    return stored, _restore_tree(path, manifest, shardings, dtype, target_table(stored), verify, progress)


def restore_drafter(
    ckpt_dir: str | os.PathLike,
    *,
    mesh: Mesh | None = None,
    dtype: str | None = None,
    verify: bool = True,
    progress: bool | None = None,
) -> tuple[DrafterConfig, dict]:
    """(DrafterConfig, parameter tree of jax arrays) from a converted DFlash drafter checkpoint."""
    from k26jax.model.drafter import drafter_partition_specs

    path = os.fspath(ckpt_dir)
    manifest = read_manifest(path)
    if manifest.get("kind") != "drafter":
        raise ValueError(f"{path}: holds a {manifest.get('kind')!r} checkpoint, not a DFlash drafter")
    dcfg = DrafterConfig.from_dict(manifest["hf_config"], source=f"{path}/{MANIFEST_FILE}: hf_config")
    specs = drafter_partition_specs(dcfg, mesh.shape[sharding.MODEL] if mesh is not None else 1)
    shardings = _shardings(manifest, specs, mesh)
    return dcfg, _restore_tree(path, manifest, shardings, dtype, drafter_table(dcfg), verify, progress)
