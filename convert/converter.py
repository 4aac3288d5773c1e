"""HF K2 / K2.5 / K2.6 (+ a z-lab DFlash drafter) -> a k26jax orbax checkpoint, one layer at a time.

Streaming: the work is a list of steps ("top": final norm, embed and lm_head in row blocks; "layer i"; "drafter").
A step reads its tensors one by one (k26jax.hf), assembles one leaf slice at a time and writes it into the stacked
zarr array at [layer index] (zarr_tree), so peak host memory is about one leaf of one layer plus the mapped source
pages it came from. A slice covers whole chunks, and a chunk file holds exactly its chunk's C-order bytes
(uncompressed), so each chunk's sha256 is computed from the slice in memory, in a thread pool, while tensorstore
writes it: the manifest gets one sha256 per chunk file, which the loader checks as it reads (k26jax/checkpoint.py).

Resume and atomicity:
  * everything is built in the staging directory OUT.partial/; OUT itself appears only at the end, by one rename;
  * OUT.partial/plan.json pins the source (config, index, shard sizes) and the options; --resume refuses a plan
    that differs;
  * OUT.partial/journal.jsonl gets one line per finished step, with the sha256 of every chunk it wrote, appended
    (and fsynced) only after all of the step's slices are in the files. A step cut short by kill -9 is not in the
    journal and is redone whole on --resume; its chunk files are simply overwritten (chunks never span layers);
  * at the end: orbax's _METADATA, manifest.json (per leaf: shape, dtype, chunks, chunk_sha256), then COMPLETE
    holding the manifest's sha256, then the rename. The loader refuses any directory without a matching COMPLETE;
  * --overwrite replaces only a k26jax checkpoint (a COMPLETE marker of ours) or a conversion of ours (plan.json),
    never another directory or a file.

The drafter: a drafter/ directory beside the HF checkpoint is converted into OUT/drafter unless told otherwise.
Messages name the options the way the caller gave them: CLI flags from `python -m convert`, keyword arguments from
Python.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np
from jax.sharding import AbstractMesh, PartitionSpec

from convert.zarr_tree import ZarrTree
from k26jax import checkpoint, hf, sharding
from k26jax.checkpoint import (
    COMPLETE_FILE,
    DRAFTER_DIR,
    FORMAT,
    MANIFEST_FILE,
    PARAMS_DIR,
    all_chunk_keys,
    chunk_key,
    chunks_in,
    flatten_tree,
)
from k26jax.config import ConfigError, DrafterConfig, ModelConfig
from k26jax.hf_files import INDEX_FILE, CheckpointError, HFCheckpoint, check_tensor_files
from k26jax.model import params as param_table
from k26jax.model.drafter import abstract_params, drafter_partition_specs

STAGING_SUFFIX = ".partial"
PLAN_FILE, JOURNAL_FILE = "plan.json", "journal.jsonl"
COPIED_FILES = ("config.json", "generation_config.json", "tiktoken.model", "tokenizer_config.json")
KILL_HOOK = "K26JAX_CONVERT_KILL_AFTER_PIECES"  # tests: SIGKILL this process after N slices are written
TOP_CHUNK_BYTES = 64 << 20
FORMAT_FAMILY = "k26jax-orbax-"  # any version's COMPLETE or plan.json marks a directory --overwrite may replace


@dataclasses.dataclass
class Options:
    hf_dir: str
    out: str
    expert_mode: str = "ep"
    mesh: int = 8  # size of the "model" axis the chunks are cut for
    dtype: str = "bfloat16"
    drafter_dir: str | None | bool = None  # None: HF_DIR/drafter when it exists; False: no drafter
    dry_run: bool = False
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    cli: bool = False  # messages name the CLI's flags (else the keyword arguments)

    def flag(self, field: str, value=True) -> str:
        """How the caller names `field` set to `value`: `--resume`, `--out X` (CLI) or `resume=True`, `out='X'`."""
        if not self.cli:
            return f"{field}={value!r}"
        if field == "drafter_dir" and value is False:
            return "--no-drafter"
        return _FLAGS[field] + ("" if isinstance(value, bool) else f" {value}")


_FLAGS = {
    "hf_dir": "--hf",
    "out": "--out",
    "expert_mode": "--expert-sharding",
    "mesh": "--mesh",
    "dtype": "--dtype",
    "drafter_dir": "--drafter",
    "resume": "--resume",
    "overwrite": "--overwrite",
}


@dataclasses.dataclass
class _Step:
    name: str
    rows: dict[str, tuple[int, int]]  # leaf -> the rows [start, stop) of axis 0 this step writes
    pieces: Callable[[], Iterator]  # yields (leaf path, index, array)
    source_prefix: str | None = None  # HF tensor names this step reads (prefetched while the step before runs)


@dataclasses.dataclass
class _Job:
    """One checkpoint to build: the target in OUT, or the drafter in OUT/drafter."""

    kind: str
    subdir: str
    hf_config: dict
    generation_config: dict | None
    leaves: dict[str, dict]  # flat name -> {shape, dtype, chunks}
    steps: list[_Step]

    def step_bytes(self, step: _Step) -> int:
        return sum((stop - start) * _row_bytes(self.leaves[name]) for name, (start, stop) in step.rows.items())


def _row_bytes(leaf: dict) -> int:
    return int(np.prod(leaf["shape"][1:])) * _np_dtype(leaf["dtype"]).itemsize


def _np_dtype(name: str) -> np.dtype:
    return hf.BF16 if name == "bfloat16" else np.dtype(name)


# ---- planning ----------------------------------------------------------------------------------------------
def _chunks(shape, dtype, spec: PartitionSpec, mesh: AbstractMesh, stacked: bool) -> list[int]:
    """One device's shard, cut to one layer ([1, *shard]) for stacked leaves, else to <= TOP_CHUNK_BYTES rows."""
    spec = sharding.fit_spec(spec, tuple(shape), mesh)
    axes = tuple(spec) + (None,) * (len(shape) - len(spec))
    chunks = [dim // (1 if axis is None else mesh.shape[axis]) for dim, axis in zip(shape, axes)]
    if stacked:
        chunks[0] = 1
    else:
        row_bytes = int(np.prod(chunks[1:])) * _np_dtype(str(np.dtype(dtype))).itemsize
        chunks[0] = max(
            d for d in range(1, chunks[0] + 1) if chunks[0] % d == 0 and (d * row_bytes <= TOP_CHUNK_BYTES or d == 1)
        )
    return chunks


def _stacked(table: dict) -> Callable[[str], bool]:
    """Whether a flat leaf name belongs to a layer stack of the table."""
    stacks = tuple(key + "." for key, node in table.items() if isinstance(node, param_table.Stack))
    return lambda name: name.startswith(stacks)


def _leaves(shapes: dict, specs: dict, mesh: AbstractMesh, stacked: Callable[[str], bool]) -> dict[str, dict]:
    shapes, specs = flatten_tree(shapes), flatten_tree(specs)
    if set(shapes) != set(specs):
        raise RuntimeError(f"parameter tree and sharding specs differ: {sorted(set(shapes) ^ set(specs))}")
    return {
        name: {
            "shape": list(shape),
            "dtype": str(np.dtype(dtype)),
            "chunks": _chunks(shape, dtype, specs[name], mesh, stacked(name)),
        }
        for name, (shape, dtype) in shapes.items()
    }


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _target_job(opts: Options, mesh: AbstractMesh) -> tuple[_Job, ModelConfig, HFCheckpoint]:
    cfg = ModelConfig.from_hf_dir(opts.hf_dir)
    source = HFCheckpoint(opts.hf_dir)
    hf.validate(source, cfg)
    source.release()
    shapes = hf.param_shapes(cfg, opts.dtype)
    specs = sharding.param_partition_specs(cfg, opts.expert_mode)
    leaves = _leaves(shapes, specs, mesh, _stacked(param_table.target_table(cfg)))
    top = {name: leaves[name]["chunks"][0] for name in leaves if "." not in name}  # rows per block
    steps = [
        _Step(
            "top",
            {name: (0, leaves[name]["shape"][0]) for name in top},
            lambda: hf.top_pieces(source, cfg, opts.dtype, top),
        )
    ]
    for layer in range(cfg.num_hidden_layers):
        kind, i = hf.kind_index(cfg, layer)
        rows = {name: (i, i + 1) for name in leaves if name.startswith(kind + ".")}
        steps.append(
            _Step(
                f"layer {layer}",
                rows,
                lambda layer=layer, kind=kind, i=i: (
                    ((kind, *path), (i,), arr) for path, arr in hf.layer_pieces(source, cfg, layer, opts.dtype)
                ),
                source_prefix=f"model.layers.{layer}.",
            )
        )
    job = _Job(
        "target",
        "",
        _read_json(os.path.join(opts.hf_dir, "config.json")),
        _read_json(os.path.join(opts.hf_dir, "generation_config.json")),
        leaves,
        steps,
    )
    return job, cfg, source


def _drafter_job(opts: Options, target: ModelConfig, mesh: AbstractMesh) -> _Job:
    dcfg = DrafterConfig.from_hf_dir(opts.drafter_dir)
    dcfg.check_target(target)
    check_tensor_files(opts.drafter_dir)
    abstract = abstract_params(dcfg, jax.numpy.float32 if opts.dtype == "float32" else jax.numpy.bfloat16)
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
    specs = drafter_partition_specs(dcfg, mesh.shape[sharding.MODEL])
    leaves = _leaves(shapes, specs, mesh, _stacked(param_table.drafter_table(dcfg)))
    dtype = hf.DTYPES[opts.dtype]

    def pieces():
        params = flatten_tree(hf.read_drafter_params(opts.drafter_dir, dcfg))
        for name in leaves:
            yield tuple(name.split(".")), (), np.asarray(params.pop(name)).astype(dtype)

    step = _Step("drafter", {name: (0, leaf["shape"][0]) for name, leaf in leaves.items()}, pieces)
    return _Job("drafter", DRAFTER_DIR, _read_json(os.path.join(opts.drafter_dir, "config.json")), None, leaves, [step])


def _file_sha256(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _plan(opts: Options, source: HFCheckpoint) -> dict:
    """What a resumed run must agree on: the source files and the options."""
    return {
        "format": FORMAT,
        "hf_dir": os.path.abspath(opts.hf_dir),
        "config_sha256": _file_sha256(os.path.join(opts.hf_dir, "config.json")),
        "index_sha256": _file_sha256(os.path.join(opts.hf_dir, INDEX_FILE)),
        "shard_bytes": {
            f: os.path.getsize(os.path.join(opts.hf_dir, f))
            for f in sorted({e["file"] for e in source.entries.values()})
        },
        "drafter_dir": opts.drafter_dir and os.path.abspath(opts.drafter_dir),
        "drafter_config_sha256": opts.drafter_dir and _file_sha256(os.path.join(opts.drafter_dir, "config.json")),
        "dtype": opts.dtype,
        "expert_mode": opts.expert_mode,
        "mesh": opts.mesh,
    }


# ---- output directory policy -------------------------------------------------------------------------------
def _ours(path: str) -> str | None:
    """What of ours `path` is: "checkpoint" (our COMPLETE), "partial" (our plan.json), "empty"; None: not ours."""
    if not os.path.isdir(path) or os.path.islink(path):
        return None
    if not os.listdir(path):
        return "empty"
    for kind, file in (("checkpoint", COMPLETE_FILE), ("partial", PLAN_FILE)):
        try:
            marker = _read_json(os.path.join(path, file))
        except (OSError, ValueError):
            continue
        if isinstance(marker, dict) and str(marker.get("format")).startswith(FORMAT_FAMILY):
            return kind
    return None


def _check_out(opts: Options) -> None:
    """Refuses an OUT (or OUT.partial) that is not ours to replace, before anything is read or written."""
    out, staging = opts.out, opts.out + STAGING_SUFFIX
    kind = _ours(out) if os.path.lexists(out) else "absent"
    if kind is None:
        what = (
            "a directory that is not a k26jax checkpoint" if os.path.isdir(out) else "a file, not a k26jax checkpoint"
        )
        raise FileExistsError(
            f"{opts.flag('out', out)}: {what}; it is left alone ({opts.flag('overwrite')} only replaces a k26jax "
            f"checkpoint): choose a new output path"
        )
    nothing_to_resume = opts.resume and not os.path.lexists(staging)
    if kind in ("checkpoint", "partial") and not opts.overwrite and not nothing_to_resume:
        raise FileExistsError(f"{opts.flag('out', out)}: already exists; pass {opts.flag('overwrite')} to replace it")
    if os.path.lexists(staging) and _ours(staging) not in ("partial", "empty"):
        raise FileExistsError(
            f"{staging}: the staging directory of {opts.flag('out', out)} holds something that is not a k26jax "
            f"conversion (no plan.json of ours); it is left alone: move it away or choose a new output path"
        )


def _prepare_staging(opts: Options, plan: dict) -> tuple[str, dict[str, dict]]:
    """Checks OUT.partial against resume / overwrite; returns (staging dir, chunk sha256s of the finished steps)."""
    staging = opts.out + STAGING_SUFFIX
    if os.path.exists(staging):
        if opts.overwrite:
            shutil.rmtree(staging)
        elif not opts.resume:
            raise FileExistsError(
                f"{staging}: an interrupted conversion is there; pass {opts.flag('resume')} to continue it "
                f"or {opts.flag('overwrite')} to start over"
            )
    if os.path.exists(staging):
        old = _read_json(os.path.join(staging, PLAN_FILE)) or {}
        if old != plan:
            diff = sorted(k for k in set(plan) | set(old) if old.get(k) != plan.get(k))
            raise ValueError(
                f"{staging}: cannot resume: it was started with a different source or options "
                f"(differs in {diff}); pass {opts.flag('overwrite')} to start over"
            )
        return staging, _journal(staging)
    os.makedirs(staging)
    with open(os.path.join(staging, PLAN_FILE), "w") as f:
        json.dump(plan, f, indent=1)
    return staging, {}


def _journal(staging: str) -> dict[str, dict]:
    """The finished steps: step key -> {leaf: {chunk key: sha256}}."""
    path, done = os.path.join(staging, JOURNAL_FILE), {}
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    entry = json.loads(line)
                    done[entry["step"]] = entry["sha256"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    break  # a line torn by the crash: it and anything after it do not count
    return done


def _log_step(staging: str, step: str, sums: dict[str, dict]) -> None:
    with open(os.path.join(staging, JOURNAL_FILE), "a") as f:
        f.write(json.dumps({"step": step, "sha256": sums}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _with_drafter(opts: Options, log: Callable[[str], None]) -> tuple[Options, bool]:
    """opts with drafter_dir resolved (a directory or False); whether it was found beside the HF checkpoint."""
    if opts.drafter_dir is None:
        found = os.path.join(opts.hf_dir, DRAFTER_DIR)
        if os.path.isdir(found):
            skip = opts.flag("drafter_dir", False)
            log(f"converting the DFlash drafter found in {found} into {DRAFTER_DIR}/ ({skip} skips it)")
            return dataclasses.replace(opts, drafter_dir=found), True
        log(
            f"no {DRAFTER_DIR}/ in {opts.hf_dir}: the output has no drafter, so only method 'ar' (no speculation) "
            f"runs on it (add one with {opts.flag('drafter_dir', 'DIR')})"
        )
        return dataclasses.replace(opts, drafter_dir=False), False
    if opts.drafter_dir is True:
        raise ValueError(f"drafter_dir=True: give a directory, None (use HF_DIR/{DRAFTER_DIR} if any) or False")
    return opts, False


# ---- running -----------------------------------------------------------------------------------------------
def convert(opts: Options, log: Callable[[str], None] = print) -> dict:
    """Runs the conversion (or only its validation with dry_run); returns a summary dict."""
    if opts.expert_mode not in sharding.EXPERT_MODES:
        raise ValueError(f"{opts.flag('expert_mode', opts.expert_mode)}: use one of {sharding.EXPERT_MODES}")
    if opts.dtype not in hf.DTYPES:
        raise ValueError(f"{opts.flag('dtype', opts.dtype)}: use one of {tuple(hf.DTYPES)}")
    if opts.mesh < 1:
        raise ValueError(f"{opts.flag('mesh', opts.mesh)}: must be >= 1")
    out_abs, hf_abs = os.path.abspath(opts.out), os.path.abspath(opts.hf_dir)
    if out_abs == hf_abs or out_abs.startswith(hf_abs + os.sep) or hf_abs.startswith(out_abs + os.sep):
        raise ValueError(f"{opts.flag('out', opts.out)}: must not be, contain or lie inside the HF checkpoint")
    _check_out(opts)
    mesh = AbstractMesh((1, opts.mesh), (sharding.DATA, sharding.MODEL))
    target, cfg, source = _target_job(opts, mesh)
    opts, found = _with_drafter(opts, log)
    jobs = [target]
    if opts.drafter_dir:
        try:
            jobs.append(_drafter_job(opts, cfg, mesh))
        except (CheckpointError, ConfigError) as e:
            if not found:
                raise
            raise type(e)(f"{e} (the drafter beside the checkpoint; {opts.flag('drafter_dir', False)} skips it)") from e
    total = sum(job.step_bytes(step) for job in jobs for step in job.steps)
    summary = {
        "total_bytes": total,
        "skipped": source.skipped_summary() or "nothing",
        "leaves": sum(len(job.leaves) for job in jobs),
        "steps": sum(len(job.steps) for job in jobs),
        "drafter": bool(opts.drafter_dir),
    }
    log(
        f"{opts.hf_dir}: {cfg.num_hidden_layers} layers ({cfg.num_dense_layers} dense, {cfg.num_moe_layers} MoE), "
        f"{total / 1e9:.3f} GB to write; skipped {summary['skipped']}"
    )
    if opts.dry_run:
        for job in jobs:
            for name, leaf in job.leaves.items():
                log(f"  {job.kind:7s} {name:28s} {leaf['dtype']:8s} {leaf['shape']} chunks {leaf['chunks']}")
        return summary
    if opts.resume and os.path.exists(opts.out) and not os.path.exists(opts.out + STAGING_SUFFIX):
        checkpoint.read_manifest(opts.out)  # raises unless complete
        log(f"{opts.out} is already complete; nothing to resume")
        return summary
    staging, done = _prepare_staging(opts, _plan(opts, source))
    for name in COPIED_FILES:
        if os.path.isfile(os.path.join(opts.hf_dir, name)):
            shutil.copyfile(os.path.join(opts.hf_dir, name), os.path.join(staging, name))
    trees = [ZarrTree(os.path.join(staging, job.subdir, PARAMS_DIR), job.leaves) for job in jobs]
    if done:
        log(f"resuming {staging}: {len(done)} of {summary['steps']} steps already done")
    start = time.perf_counter()
    sums = _write_steps(jobs, trees, staging, done, total, source, opts.progress)
    for job, tree in reversed(list(zip(jobs, trees))):  # the target's COMPLETE last
        _finish(job, tree, sums[job.kind], os.path.join(staging, job.subdir), opts, source)
    summary["write_s"] = time.perf_counter() - start
    if os.path.exists(opts.out):  # --overwrite: swap in the new checkpoint, then drop the old one
        old = f"{opts.out}.old-{os.getpid()}"
        os.rename(opts.out, old)
        os.rename(staging, opts.out)
        shutil.rmtree(old)
    else:
        os.rename(staging, opts.out)
    log(f"wrote {opts.out}")
    return summary


def _piece_chunks(leaf: dict, index: tuple, arr: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(chunk key, chunk view) for each chunk of leaf[index] that `arr` (written there) covers; the slice must hold
    whole chunks."""
    shape, chunks = leaf["shape"], leaf["chunks"]
    region, full = [], []
    for d, dim in enumerate(shape):
        at = index[d] if d < len(index) else slice(None)
        start, stop = (at, at + 1) if isinstance(at, (int, np.integer)) else at.indices(dim)[:2]
        if start % chunks[d] or (stop % chunks[d] and stop != dim):
            raise RuntimeError(f"slice {index} of a leaf chunked {chunks} cuts a chunk")
        region.append((start, stop))
        full.append(stop - start)
    arr = arr.reshape(full)
    for g in chunks_in(tuple(region), chunks):
        yield chunk_key(g), arr[tuple(slice(i * c - a, i * c + c - a) for i, c, (a, _) in zip(g, chunks, region))]


def _sha256(chunk: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(chunk).view(np.uint8)).hexdigest()


def _write_steps(jobs, trees, staging, done: dict, total: int, source, progress: bool) -> dict[str, dict]:
    """Writes the steps not yet done; returns {job kind: {leaf: {chunk key: sha256}}} over all steps."""
    from tqdm import tqdm

    kill_after = int(os.environ.get(KILL_HOOK, "0"))
    written = 0
    initial = sum(job.step_bytes(s) for job in jobs for s in job.steps if f"{job.kind}:{s.name}" in done)
    sums = {job.kind: {name: {} for name in job.leaves} for job in jobs}
    bar = tqdm(
        total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024, desc="convert",
        disable=not progress, smoothing=0.1,
    )  # fmt: skip
    with bar, concurrent.futures.ThreadPoolExecutor() as pool:
        for job, tree in zip(jobs, trees):
            for k, step in enumerate(job.steps):
                key = f"{job.kind}:{step.name}"
                if key in done:
                    for name, chunk_sums in done[key].items():
                        sums[job.kind][name].update(chunk_sums)
                    continue
                bar.set_postfix_str(key, refresh=False)
                if k + 1 < len(job.steps) and job.steps[k + 1].source_prefix:
                    source.prefetch(job.steps[k + 1].source_prefix)
                step_sums = {}
                for path, index, arr in step.pieces():
                    name, arr = ".".join(path), np.ascontiguousarray(arr)
                    pending = tree.write(name, index, arr)
                    hashes = {ck: pool.submit(_sha256, c) for ck, c in _piece_chunks(job.leaves[name], index, arr)}
                    step_sums.setdefault(name, {}).update({ck: h.result() for ck, h in hashes.items()})
                    pending.result()
                    bar.update(arr.nbytes)
                    del arr
                    source.release()
                    written += 1
                    if kill_after and written >= kill_after:
                        os.kill(os.getpid(), signal.SIGKILL)
                _log_step(staging, key, step_sums)
                for name, chunk_sums in step_sums.items():
                    sums[job.kind][name].update(chunk_sums)
    return sums


def _finish(job: _Job, tree: ZarrTree, sums: dict, job_dir: str, opts: Options, source: HFCheckpoint) -> None:
    """orbax metadata, manifest, then the COMPLETE marker."""
    tree.write_orbax_metadata()
    leaves = {}
    for name, leaf in job.leaves.items():
        keys = all_chunk_keys(leaf["shape"], leaf["chunks"])
        if set(keys) != set(sums[name]):
            raise RuntimeError(f"{name}: chunks without a sha256: {sorted(set(keys) - set(sums[name]))[:4]}")
        leaves[name] = dict(leaf, chunk_sha256={k: sums[name][k] for k in keys})
    manifest = {
        "format": FORMAT,
        "kind": job.kind,
        "hf_config": job.hf_config,
        "generation_config": job.generation_config,
        "dtype": opts.dtype,
        "expert_mode": opts.expert_mode,
        "mesh": opts.mesh,
        "source": os.path.abspath(opts.hf_dir if job.kind == "target" else opts.drafter_dir),
        "skipped": {g: {"tensors": n, "bytes": b} for g, (n, b) in source.skipped.items()}
        if job.kind == "target"
        else {},
        "leaves": leaves,
    }
    raw = json.dumps(manifest, indent=1).encode()
    with open(os.path.join(job_dir, MANIFEST_FILE), "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(job_dir, COMPLETE_FILE), "w") as f:
        json.dump({"format": FORMAT, "manifest_sha256": hashlib.sha256(raw).hexdigest()}, f)
        f.flush()
        os.fsync(f.fileno())
