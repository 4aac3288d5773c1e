"""HF K2 / K2.5 / K2.6 (+ a z-lab DFlash drafter) -> a k26jax orbax checkpoint, one layer at a time.

Streaming: the work is a list of steps ("top": embed / final norm / lm_head in vocabulary blocks; "layer i"; "drafter").
A step reads its tensors one by one (hf_layout), assembles one leaf slice at a time and writes it into the stacked
zarr array at [layer index] (zarr_tree), so peak host memory is about one leaf of one layer plus its copy in flight.

Resume and atomicity:
  * everything is built in the staging directory OUT.partial/; OUT itself appears only at the end, by one rename;
  * OUT.partial/plan.json pins the source (index, config, shard sizes) and the options; --resume refuses a plan
    that differs;
  * OUT.partial/journal.jsonl gets one line per finished step, appended only after all of the step's slices are
    written. A step cut short by kill -9 is not in the journal and is redone whole on --resume; its chunk files are
    simply overwritten (chunks never span layers);
  * at the end the manifest's per-leaf sha256 are computed by reading the arrays back from disk (so they certify
    the files, and nothing has to survive a crash but the journal), then COMPLETE (holding the manifest's sha256)
    is written, and OUT.partial is renamed to OUT. The loader refuses any directory without a matching COMPLETE.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
from collections.abc import Callable, Iterator

import jax
import numpy as np
from jax.sharding import AbstractMesh, PartitionSpec

from convert import hf_layout
from convert.hf_layout import CheckpointError, HFCheckpoint
from convert.zarr_tree import ZarrTree
from k26jax import sharding
from k26jax.checkpoint import COMPLETE_FILE, DRAFTER_DIR, FORMAT, MANIFEST_FILE, PARAMS_DIR
from k26jax.config import DrafterConfig, ModelConfig

STAGING_SUFFIX = ".partial"
PLAN_FILE, JOURNAL_FILE = "plan.json", "journal.jsonl"
COPIED_FILES = ("config.json", "generation_config.json", "tiktoken.model", "tokenizer_config.json")
KILL_HOOK = "K26JAX_CONVERT_KILL_AFTER_PIECES"  # tests: SIGKILL this process after N slices are written


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
class _Job:
    """One checkpoint to build (the target, or the drafter in OUT/drafter)."""
    kind: str
    subdir: str
    hf_config: dict
    generation_config: dict | None
    leaves: dict[str, dict]  # flat name -> {shape, dtype, chunks}
    steps: list[tuple[str, int, Callable[[], Iterator]]]  # (name, bytes, pieces: (leaf name, index, array))


# ---- planning ----------------------------------------------------------------------------------------------
def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _chunks(shape, spec: PartitionSpec, mesh: AbstractMesh, stacked: bool) -> list[int]:
    """One device's shard of one layer: [1, *shard] for stacked leaves, the shard shape otherwise."""
    spec = sharding.fit_spec(spec, tuple(shape), mesh)
    axes = tuple(spec) + (None,) * (len(shape) - len(spec))
    chunks = [dim // (1 if axis is None else mesh.shape[axis]) for dim, axis in zip(shape, axes)]
    if stacked:
        chunks[0] = 1
    return chunks


def _leaves(shapes: dict, specs: dict, mesh: AbstractMesh, stacked: Callable[[str], bool]) -> dict[str, dict]:
    shapes, specs = _flatten(shapes), _flatten(specs)
    if set(shapes) != set(specs):
        raise RuntimeError(f"parameter tree and sharding specs differ: {sorted(set(shapes) ^ set(specs))}")
    return {name: {"shape": list(shape), "dtype": str(np.dtype(dtype)),
                   "chunks": _chunks(shape, specs[name], mesh, stacked(name))}
            for name, (shape, dtype) in shapes.items()}


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _target_job(opts: Options, mesh: AbstractMesh) -> tuple[_Job, ModelConfig, HFCheckpoint]:
    cfg = ModelConfig.from_hf_dir(opts.hf_dir)
    hf = HFCheckpoint(opts.hf_dir)
    hf_layout.validate(hf, cfg)
    shapes = hf_layout.param_shapes(cfg, opts.dtype)
    specs = sharding.param_partition_specs(cfg, opts.expert_mode)
    leaves = _leaves(shapes, specs, mesh, stacked=lambda name: name.split(".")[0] in ("dense", "moe"))
    nbytes = {name: int(np.prod(leaf["shape"])) * np.dtype(_np_dtype(leaf["dtype"])).itemsize
              for name, leaf in leaves.items()}
    top_bytes = sum(b for name, b in nbytes.items() if "." not in name)
    embed_rows = leaves["embed"]["chunks"][0]
    steps = [("top", top_bytes, lambda: hf_layout.top_pieces(hf, cfg, opts.dtype, rows=embed_rows))]
    counts = {"dense": cfg.num_dense_layers, "moe": cfg.num_moe_layers}
    for layer in range(cfg.num_hidden_layers):
        kind, i = hf_layout.kind_index(cfg, layer)
        layer_bytes = sum(b for name, b in nbytes.items() if name.startswith(kind + ".")) // counts[kind]
        steps.append((f"layer {layer}", layer_bytes,
                      lambda layer=layer, kind=kind, i=i: (((kind, *path), (i,), arr) for path, arr in
                                                           hf_layout.layer_pieces(hf, cfg, layer, opts.dtype))))
    job = _Job("target", "", _read_json(os.path.join(opts.hf_dir, "config.json")),
               _read_json(os.path.join(opts.hf_dir, "generation_config.json")), leaves, steps)
    return job, cfg, hf


def _drafter_job(opts: Options, target: ModelConfig, mesh: AbstractMesh) -> _Job:
    from convert import dflash_layout
    from k26jax.model.drafter import abstract_params, drafter_partition_specs

    dcfg = DrafterConfig.from_hf_dir(opts.drafter_dir)
    dcfg.check_target(target)
    abstract = abstract_params(dcfg, jax.numpy.float32 if opts.dtype == "float32" else jax.numpy.bfloat16)
    shapes = jax.tree.map(lambda a: (a.shape, a.dtype), abstract)
    specs = drafter_partition_specs(dcfg, mesh.shape[sharding.MODEL])
    leaves = _leaves(shapes, specs, mesh, stacked=lambda name: name.startswith("layers."))
    dtype = hf_layout.DTYPES[opts.dtype]

    def pieces():
        params = _flatten(dflash_layout.read_drafter_params(opts.drafter_dir, dcfg))
        for name in leaves:
            yield tuple(name.split(".")), (), np.asarray(params.pop(name)).astype(dtype)

    nbytes = sum(int(np.prod(leaf["shape"])) * dtype.itemsize for leaf in leaves.values())
    return _Job("drafter", DRAFTER_DIR, _read_json(os.path.join(opts.drafter_dir, "config.json")), None, leaves,
                [("drafter", nbytes, pieces)])


def _np_dtype(name: str):
    return hf_layout.BF16 if name == "bfloat16" else np.dtype(name)


def _file_sha256(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _plan(opts: Options, hf: HFCheckpoint) -> dict:
    """What a resumed run must agree on: the source files and the options."""
    return {"format": FORMAT, "hf_dir": os.path.abspath(opts.hf_dir),
            "config_sha256": _file_sha256(os.path.join(opts.hf_dir, "config.json")),
            "index_sha256": _file_sha256(os.path.join(opts.hf_dir, hf_layout.INDEX_FILE)),
            "shard_bytes": {f: os.path.getsize(os.path.join(opts.hf_dir, f))
                            for f in sorted({e["file"] for e in hf.entries.values()})},
            "drafter_dir": opts.drafter_dir and os.path.abspath(opts.drafter_dir),
            "drafter_config_sha256": opts.drafter_dir and _file_sha256(os.path.join(opts.drafter_dir, "config.json")),
            "dtype": opts.dtype, "expert_mode": opts.expert_mode, "mesh": opts.mesh}


# ---- output directory policy -------------------------------------------------------------------------------
def _prepare_staging(opts: Options, plan: dict) -> tuple[str, set[str]]:
    """Checks OUT and OUT.partial against --resume / --overwrite; returns (staging dir, finished steps)."""
    out, staging = opts.out, opts.out + STAGING_SUFFIX
    if os.path.exists(out) and not opts.overwrite:
        raise FileExistsError(f"--out {out}: already exists; pass --overwrite to replace it")
    if os.path.exists(staging):
        if opts.overwrite:
            shutil.rmtree(staging)
        elif not opts.resume:
            raise FileExistsError(f"{staging}: an interrupted conversion is there; pass --resume to continue it "
                                  f"or --overwrite to start over")
    if os.path.exists(staging):
        old = _read_json(os.path.join(staging, PLAN_FILE))
        if old != plan:
            diff = sorted(k for k in set(plan) | set(old or {}) if (old or {}).get(k) != plan.get(k))
            raise ValueError(f"{staging}: cannot --resume: it was started with a different source or options "
                             f"(differs in {diff}); pass --overwrite to start over")
        return staging, _journal(staging)
    os.makedirs(staging)
    with open(os.path.join(staging, PLAN_FILE), "w") as f:
        json.dump(plan, f, indent=1)
    return staging, set()


def _journal(staging: str) -> set[str]:
    path, done = os.path.join(staging, JOURNAL_FILE), set()
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    done.add(json.loads(line)["step"])
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
    if opts.dtype not in hf_layout.DTYPES:
        raise ValueError(f"--dtype {opts.dtype!r}: use one of {tuple(hf_layout.DTYPES)}")
    if opts.mesh < 1:
        raise ValueError(f"--mesh {opts.mesh}: must be >= 1")
    out_abs, hf_abs = os.path.abspath(opts.out), os.path.abspath(opts.hf_dir)
    if out_abs == hf_abs or out_abs.startswith(hf_abs + os.sep) or hf_abs.startswith(out_abs + os.sep):
        raise ValueError(f"--out {opts.out}: must not be or contain (or lie inside) --hf {opts.hf_dir}")
    mesh = AbstractMesh((1, opts.mesh), (sharding.DATA, sharding.MODEL))
    target, cfg, hf = _target_job(opts, mesh)
    jobs = [target] + ([_drafter_job(opts, cfg, mesh)] if opts.drafter_dir else [])
    total = sum(b for job in jobs for _, b, _ in job.steps)
    summary = {"total_bytes": total, "skipped": hf.skipped_summary() or "nothing",
               "leaves": sum(len(job.leaves) for job in jobs), "steps": sum(len(job.steps) for job in jobs)}
    log(f"{opts.hf_dir}: {cfg.num_hidden_layers} layers ({cfg.num_dense_layers} dense, {cfg.num_moe_layers} MoE), "
        f"{total / 1e9:.3f} GB to write; skipped {summary['skipped']}")
    if opts.dry_run:
        for job in jobs:
            for name, leaf in job.leaves.items():
                log(f"  {job.kind:7s} {name:28s} {leaf['dtype']:8s} {leaf['shape']} chunks {leaf['chunks']}")
        return summary
    staging, done = _prepare_staging(opts, _plan(opts, hf))
    if done:
        log(f"resuming {staging}: {len(done)} of {summary['steps']} steps already done")
    for name in COPIED_FILES:
        if os.path.isfile(os.path.join(opts.hf_dir, name)):
            shutil.copyfile(os.path.join(opts.hf_dir, name), os.path.join(staging, name))
    trees = [ZarrTree(os.path.join(staging, job.subdir, PARAMS_DIR), job.leaves) for job in jobs]
    _write_steps(jobs, trees, staging, done, total, hf, opts.progress)
    for job, tree in reversed(list(zip(jobs, trees))):  # the drafter's COMPLETE first, the target's last
        _finish(job, tree, os.path.join(staging, job.subdir), opts, hf, opts.progress)
    if os.path.exists(opts.out):  # --overwrite: swap in the new checkpoint, then drop the old one
        old = f"{opts.out}.old-{os.getpid()}"
        os.rename(opts.out, old)
        os.rename(staging, opts.out)
        shutil.rmtree(old)
    else:
        os.rename(staging, opts.out)
    log(f"wrote {opts.out}")
    return summary


def _write_steps(jobs, trees, staging, done, total, hf, progress) -> None:
    from tqdm import tqdm

    kill_after = int(os.environ.get(KILL_HOOK, "0"))
    written = 0
    initial = sum(b for job in jobs for step, b, _ in job.steps if f"{job.kind}:{step}" in done)
    with tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024, desc="convert",
              disable=not progress, smoothing=0.1) as bar:
        for job, tree in zip(jobs, trees):
            for step, _, pieces in job.steps:
                key = f"{job.kind}:{step}"
                if key in done:
                    continue
                bar.set_postfix_str(key, refresh=False)
                for path, index, arr in pieces():
                    tree.write(".".join(path), index, arr)
                    bar.update(arr.nbytes)
                    del arr
                    hf.release()
                    written += 1
                    if kill_after and written >= kill_after:
                        os.kill(os.getpid(), signal.SIGKILL)
                _log_step(staging, key)


def _finish(job: _Job, tree: ZarrTree, job_dir: str, opts: Options, hf: HFCheckpoint, progress: bool) -> None:
    """orbax metadata, checksums read back from disk, manifest, then the COMPLETE marker."""
    from tqdm import tqdm

    tree.write_orbax_metadata()
    leaves = {}
    with tqdm(total=len(job.leaves), desc=f"checksum {job.kind}", unit="leaf", disable=not progress) as bar:
        for name, leaf in job.leaves.items():
            leaves[name] = dict(leaf, sha256=tree.sha256(name))
            bar.update()
    manifest = {"format": FORMAT, "kind": job.kind, "hf_config": job.hf_config,
                "generation_config": job.generation_config, "dtype": opts.dtype, "expert_mode": opts.expert_mode,
                "mesh": opts.mesh, "source": os.path.abspath(opts.hf_dir if job.kind == "target" else opts.drafter_dir),
                "skipped": {g: {"tensors": n, "bytes": b} for g, (n, b) in hf.skipped.items()}
                if job.kind == "target" else {},
                "leaves": leaves}
    raw = json.dumps(manifest, indent=1).encode()
    with open(os.path.join(job_dir, MANIFEST_FILE), "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(job_dir, COMPLETE_FILE), "w") as f:
        json.dump({"format": FORMAT, "manifest_sha256": hashlib.sha256(raw).hexdigest()}, f)
        f.flush()
        os.fsync(f.fileno())


__all__ = ["CheckpointError", "Options", "convert"]
