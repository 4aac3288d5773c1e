"""HF K2 / K2.5 / K2.6 (+ a z-lab DFlash drafter) -> a k26jax orbax checkpoint, one layer at a time.

Streaming: the work is a list of steps ("top": final norm, embed and lm_head in row blocks; "layer i"; "drafter").
A step reads its tensors one by one (k26jax.hf), assembles one leaf slice at a time and writes it into the stacked
zarr array at [layer index] (zarr_tree), so peak host memory is about one leaf of one layer plus the mapped source
pages it came from. Every leaf receives its slices in C order (layer after layer, row block after row block), so
its sha256 is computed while it is written, on the second core, as tensorstore writes.

Resume and atomicity:
  * everything is built in the staging directory OUT.partial/; OUT itself appears only at the end, by one rename;
  * OUT.partial/plan.json pins the source (config, index, shard sizes) and the options; --resume refuses a plan
    that differs;
  * OUT.partial/journal.jsonl gets one line per finished step, appended (and fsynced) only after all of the step's
    slices are in the files. A step cut short by kill -9 is not in the journal and is redone whole on --resume; its
    chunk files are simply overwritten (chunks never span layers). The finished steps are read back once to resume
    the checksums;
  * at the end: orbax's _METADATA, manifest.json (per-leaf shape, dtype, chunks, sha256), then COMPLETE holding the
    manifest's sha256, then the rename. The loader refuses any directory without a matching COMPLETE.
"""

from __future__ import annotations

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
from k26jax.checkpoint import COMPLETE_FILE, DRAFTER_DIR, FORMAT, MANIFEST_FILE, PARAMS_DIR, flatten_tree
from k26jax.config import DrafterConfig, ModelConfig
from k26jax.hf_files import INDEX_FILE, HFCheckpoint
from k26jax.model import params as param_table
from k26jax.model.drafter import abstract_params, drafter_partition_specs

STAGING_SUFFIX = ".partial"
PLAN_FILE, JOURNAL_FILE = "plan.json", "journal.jsonl"
COPIED_FILES = ("config.json", "generation_config.json", "tiktoken.model", "tokenizer_config.json")
KILL_HOOK = "K26JAX_CONVERT_KILL_AFTER_PIECES"  # tests: SIGKILL this process after N slices are written
TOP_CHUNK_BYTES = 64 << 20


@dataclasses.dataclass
class Options:
    hf_dir: str
    out: str
    expert_mode: str = "ep"
    mesh: int = 8  # size of the "model" axis the chunks are cut for
    dtype: str = "bfloat16"
    drafter_dir: str | None = None
    dry_run: bool = False
    resume: bool = False
    overwrite: bool = False
    progress: bool = True


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
def _prepare_staging(opts: Options, plan: dict) -> tuple[str, list[str]]:
    """Checks OUT and OUT.partial against --resume / --overwrite; returns (staging dir, finished steps)."""
    out, staging = opts.out, opts.out + STAGING_SUFFIX
    if os.path.exists(out) and not opts.overwrite:
        raise FileExistsError(f"--out {out}: already exists; pass --overwrite to replace it")
    if os.path.exists(staging):
        if opts.overwrite:
            shutil.rmtree(staging)
        elif not opts.resume:
            raise FileExistsError(
                f"{staging}: an interrupted conversion is there; pass --resume to continue it "
                f"or --overwrite to start over"
            )
    if os.path.exists(staging):
        old = _read_json(os.path.join(staging, PLAN_FILE)) or {}
        if old != plan:
            diff = sorted(k for k in set(plan) | set(old) if old.get(k) != plan.get(k))
            raise ValueError(
                f"{staging}: cannot --resume: it was started with a different source or options "
                f"(differs in {diff}); pass --overwrite to start over"
            )
        return staging, _journal(staging)
    os.makedirs(staging)
    with open(os.path.join(staging, PLAN_FILE), "w") as f:
        json.dump(plan, f, indent=1)
    return staging, []


def _journal(staging: str) -> list[str]:
    path, done = os.path.join(staging, JOURNAL_FILE), []
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    done.append(json.loads(line)["step"])
                except (json.JSONDecodeError, KeyError):
                    break  # a line torn by the crash: it and anything after it do not count
    return done


def _log_step(staging: str, step: str) -> None:
    with open(os.path.join(staging, JOURNAL_FILE), "a") as f:
        f.write(json.dumps({"step": step}) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ---- running -----------------------------------------------------------------------------------------------
def convert(opts: Options, log: Callable[[str], None] = print) -> dict:
    """Runs the conversion (or only its validation with dry_run); returns a summary dict."""
    if opts.expert_mode not in sharding.EXPERT_MODES:
        raise ValueError(f"--expert-sharding {opts.expert_mode!r}: use one of {sharding.EXPERT_MODES}")
    if opts.dtype not in hf.DTYPES:
        raise ValueError(f"--dtype {opts.dtype!r}: use one of {tuple(hf.DTYPES)}")
    if opts.mesh < 1:
        raise ValueError(f"--mesh {opts.mesh}: must be >= 1")
    out_abs, hf_abs = os.path.abspath(opts.out), os.path.abspath(opts.hf_dir)
    if out_abs == hf_abs or out_abs.startswith(hf_abs + os.sep) or hf_abs.startswith(out_abs + os.sep):
        raise ValueError(f"--out {opts.out}: must not be, contain or lie inside --hf {opts.hf_dir}")
    mesh = AbstractMesh((1, opts.mesh), (sharding.DATA, sharding.MODEL))
    target, cfg, source = _target_job(opts, mesh)
    jobs = [target] + ([_drafter_job(opts, cfg, mesh)] if opts.drafter_dir else [])
    total = sum(job.step_bytes(step) for job in jobs for step in job.steps)
    summary = {
        "total_bytes": total,
        "skipped": source.skipped_summary() or "nothing",
        "leaves": sum(len(job.leaves) for job in jobs),
        "steps": sum(len(job.steps) for job in jobs),
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
    hashers = [{name: hashlib.sha256() for name in job.leaves} for job in jobs]
    start = time.perf_counter()
    if done:
        log(
            f"resuming {staging}: {len(done)} of {summary['steps']} steps already done; re-reading them for the "
            f"checksums"
        )
        _rehash(jobs, trees, hashers, set(done), opts.progress)
    _write_steps(jobs, trees, hashers, staging, set(done), total, source, opts.progress)
    for job, tree, hasher in reversed(list(zip(jobs, trees, hashers))):  # the target's COMPLETE last
        _finish(job, tree, hasher, os.path.join(staging, job.subdir), opts, source)
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


def _rehash(jobs, trees, hashers, done: set[str], progress: bool) -> None:
    """Feeds the checksums with what the finished steps wrote, read back in the order it was written."""
    from tqdm import tqdm

    total = sum(job.step_bytes(s) for job in jobs for s in job.steps if f"{job.kind}:{s.name}" in done)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="re-read", disable=not progress) as bar:
        for job, tree, hasher in zip(jobs, trees, hashers):
            for step in job.steps:
                if f"{job.kind}:{step.name}" in done:
                    for name, (start, stop) in step.rows.items():
                        for block in tree.read_rows(name, start, stop):
                            hasher[name].update(block.view(np.uint8))
                            bar.update(block.nbytes)


def _write_steps(jobs, trees, hashers, staging, done: set[str], total: int, source, progress: bool) -> None:
    from tqdm import tqdm

    kill_after = int(os.environ.get(KILL_HOOK, "0"))
    written = 0
    initial = sum(job.step_bytes(s) for job in jobs for s in job.steps if f"{job.kind}:{s.name}" in done)
    with tqdm(
        total=total,
        initial=initial,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="convert",
        disable=not progress,
        smoothing=0.1,
    ) as bar:
        for job, tree, hasher in zip(jobs, trees, hashers):
            for k, step in enumerate(job.steps):
                key = f"{job.kind}:{step.name}"
                if key in done:
                    continue
                bar.set_postfix_str(key, refresh=False)
                if k + 1 < len(job.steps) and job.steps[k + 1].source_prefix:
                    source.prefetch(job.steps[k + 1].source_prefix)
                for path, index, arr in step.pieces():
                    name, arr = ".".join(path), np.ascontiguousarray(arr)
                    pending = tree.write(name, index, arr)
                    hasher[name].update(arr.view(np.uint8))  # overlaps the write; releases the GIL
                    pending.result()
                    bar.update(arr.nbytes)
                    del arr
                    source.release()
                    written += 1
                    if kill_after and written >= kill_after:
                        os.kill(os.getpid(), signal.SIGKILL)
                _log_step(staging, key)


def _finish(job: _Job, tree: ZarrTree, hasher: dict, job_dir: str, opts: Options, source: HFCheckpoint) -> None:
    """orbax metadata, manifest, then the COMPLETE marker."""
    tree.write_orbax_metadata()
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
        "leaves": {name: dict(leaf, sha256=hasher[name].hexdigest()) for name, leaf in job.leaves.items()},
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
