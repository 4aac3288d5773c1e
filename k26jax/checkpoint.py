"""Restoring checkpoints written by `python -m convert` straight onto a mesh.

A converted directory holds:
  params/         an orbax PyTree checkpoint (zarr arrays, one per stacked leaf, chunked per layer and per shard)
  manifest.json   the source config ("hf_config", "generation_config"), conversion options, and per leaf:
                  shape, dtype, chunk shape and the sha256 of the array's bytes (C order)
  COMPLETE        written last; holds the manifest's sha256. Without it the directory is not a checkpoint.
  drafter/        optionally the DFlash drafter, with the same layout
The target's directory also carries the source config.json, generation_config.json and tokenizer files.

`restore` reads every device's slice of every leaf directly from disk (orbax + tensorstore): no host gather, no
re-stacking. Any mesh works whose axes divide the shapes (sharding.fit_spec replicates dims they do not).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from k26jax import sharding
from k26jax.config import DrafterConfig, ModelConfig
from k26jax.model import params as param_table
from k26jax.model.params import drafter_table, target_table

FORMAT = "k26jax-orbax-1"
PARAMS_DIR, MANIFEST_FILE, COMPLETE_FILE = "params", "manifest.json", "COMPLETE"
DRAFTER_DIR = "drafter"
DTYPES = {"bfloat16": jax.numpy.bfloat16, "float32": np.float32}


class IncompleteCheckpointError(ValueError):
    """A directory that is not a complete converted checkpoint (e.g. an interrupted conversion)."""


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a complete checkpoint; IncompleteCheckpointError (naming what is wrong) otherwise."""
    path = os.fspath(path)
    marker = os.path.join(path, COMPLETE_FILE)
    hint = "it is not a complete k26jax checkpoint; if a conversion was interrupted, rerun it with --resume"
    if not os.path.isfile(marker):
        raise IncompleteCheckpointError(f"{path}: no {COMPLETE_FILE} marker: {hint}")
    try:
        with open(marker) as f:
            done = json.load(f)
        with open(os.path.join(path, MANIFEST_FILE), "rb") as f:
            raw = f.read()
    except (OSError, json.JSONDecodeError) as e:
        raise IncompleteCheckpointError(f"{path}: unreadable {COMPLETE_FILE} or {MANIFEST_FILE} ({e}): {hint}") from e
    if done.get("format") != FORMAT:
        raise IncompleteCheckpointError(f"{path}: format {done.get('format')!r}, this k26jax reads {FORMAT!r}")
    if done.get("manifest_sha256") != hashlib.sha256(raw).hexdigest():
        raise IncompleteCheckpointError(f"{path}: {MANIFEST_FILE} does not match the {COMPLETE_FILE} marker: {hint}")
    return json.loads(raw)


def _restore_tree(path: str, manifest: dict, shardings: dict, dtype: str | None, table: dict) -> dict:
    """Restores manifest['leaves'] (flat "a.b.c" names) into a nested dict of jax arrays; float leaves are cast to
    `dtype` except those of a fixed dtype in the parameter table (bf16 expert scales, the fp32 router bias)."""
    fixed = {".".join(path) for path in param_table.fixed_dtype_leaves(table)}
    abstract, args = {}, {}
    for name, leaf in manifest["leaves"].items():
        keys = name.split(".")
        stored = np.dtype(leaf["dtype"]) if leaf["dtype"] != "bfloat16" else np.dtype(jax.numpy.bfloat16)
        castable = jax.numpy.issubdtype(stored, jax.numpy.floating) and name not in fixed
        want = np.dtype(DTYPES[dtype]) if dtype is not None and castable else stored
        sh = shardings[name]
        _set(abstract, keys, jax.ShapeDtypeStruct(tuple(leaf["shape"]), want, sharding=sh))
        _set(args, keys, ocp.ArrayRestoreArgs(sharding=sh, dtype=want, global_shape=tuple(leaf["shape"])))
    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(
            os.path.join(os.path.abspath(path), PARAMS_DIR),
            args=ocp.args.PyTreeRestore(item=abstract, restore_args=args),
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
        device = SingleDeviceSharding(jax.devices()[0])
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
) -> tuple[ModelConfig, dict]:
    """(config, parameter tree of jax arrays) from a converted target checkpoint.

    mesh: a ("data", "model") mesh; leaves are placed with NamedSharding(mesh, param_partition_specs(cfg,
    expert_mode)) fitted to their shapes. None: the default device. dtype: float leaves are cast to it on read
    ("bfloat16" | "float32"; None keeps the stored dtype); packed ints, bf16 scales and the fp32 router bias keep
    theirs. cfg: checked against the stored config when given.
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
    return stored, _restore_tree(path, manifest, _shardings(manifest, specs, mesh), dtype, target_table(stored))


def restore_drafter(
    ckpt_dir: str | os.PathLike, *, mesh: Mesh | None = None, dtype: str | None = None
) -> tuple[DrafterConfig, dict]:
    """(DrafterConfig, parameter tree of jax arrays) from a converted DFlash drafter checkpoint."""
    from k26jax.model.drafter import drafter_partition_specs

    path = os.fspath(ckpt_dir)
    manifest = read_manifest(path)
    if manifest.get("kind") != "drafter":
        raise ValueError(f"{path}: holds a {manifest.get('kind')!r} checkpoint, not a DFlash drafter")
    dcfg = DrafterConfig.from_dict(manifest["hf_config"], source=f"{path}/{MANIFEST_FILE}: hf_config")
    specs = drafter_partition_specs(dcfg, mesh.shape[sharding.MODEL] if mesh is not None else 1)
    return dcfg, _restore_tree(path, manifest, _shardings(manifest, specs, mesh), dtype, drafter_table(dcfg))
