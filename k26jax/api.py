"""`k26jax.load` and the `Model` users hold: config, parameters on a mesh, kernel choice, optional drafter."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from k26jax import engine, ops, sharding
from k26jax.config import ModelConfig
from k26jax.model import target

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}
DEFAULT_CKPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "mini")
log = logging.getLogger(__name__)


@dataclasses.dataclass
class Model:
    cfg: ModelConfig
    params: dict
    impls: ops.Impls
    mesh: Mesh | None = None
    drafter_cfg: object | None = None
    drafter_params: dict | None = None
    path: str | None = None

    @functools.cached_property
    def tokenizer(self):
        from k26jax.tokenizer import Tokenizer

        if self.path is None:
            raise ValueError("this model has no checkpoint directory to read a tokenizer from")
        return Tokenizer(self.path)

    @property
    def dtype(self):
        return self.params["embed"].dtype

    def check_ids(self, token_ids, name="token_ids") -> np.ndarray:
        ids = np.asarray(token_ids)
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"{name}: expected an integer array [batch, tokens], got shape {ids.shape} dtype {ids.dtype}"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
            bad = ids[(ids < 0) | (ids >= self.cfg.vocab_size)][0]
            raise ValueError(f"{name}: id {bad} is outside the vocabulary [0, {self.cfg.vocab_size})")
        return ids.astype(np.int32)

    def logits(self, token_ids, hidden_layer_ids=()) -> jax.Array:
        """Full causal forward, no cache: int [B,T] -> float32 [B,T,V] (and hidden states when asked)."""
        ids = self.check_ids(token_ids)
        lengths = np.full((ids.shape[0],), ids.shape[1], np.int32)
        logits, _, feats = _prefill_jit(
            self.params, ids, lengths, cfg=self.cfg, impls=self.impls, hidden_layer_ids=tuple(hidden_layer_ids)
        )
        return (logits, feats) if hidden_layer_ids else logits

    def draft_logits(self, context_features, bonus_ids) -> jax.Array:
        """DFlash drafter, full forward, no cache: [B,Tc,n*D], [B] -> float32 [B, block_size-1, V]."""
        from k26jax.model import drafter

        if self.drafter_params is None:
            raise ValueError("this model was loaded without a drafter (pass drafter=DIR to k26jax.load)")
        bonus = self.check_ids(np.asarray(bonus_ids).reshape(-1, 1), "bonus_ids")[:, 0]
        return drafter.draft_logits(
            self.drafter_params,
            self.drafter_cfg,
            self.params["embed"],
            self.params["lm_head"],
            jnp.asarray(context_features, self.dtype),
            bonus,
        )


def _prefill(params, ids, lengths, cfg, impls, hidden_layer_ids):
    return target.forward_prefill(params, cfg, ids, lengths, impls, hidden_layer_ids)


_prefill_jit = engine.jit(_prefill, static_argnames=("cfg", "impls", "hidden_layer_ids"))


def place(params: dict, cfg: ModelConfig, mesh: Mesh | None, expert_mode: str) -> dict:
    """Put a host/device parameter tree onto the mesh (or the default device)."""
    if mesh is None:
        return jax.tree.map(jnp.asarray, params)
    specs = sharding.param_partition_specs(cfg, expert_mode)
    return jax.device_put(params, sharding.shardings_for(params, specs, mesh))


def load(
    path,
    *,
    drafter=None,
    mesh: Mesh | None = None,
    dtype: str = "bfloat16",
    expert_mode: str = "ep",
    impls: ops.Impls | None = None,
    verify: bool = True,
) -> Model:
    """Load a target (and optionally a DFlash drafter) from a HF directory or an orbax dir made by `convert`.

    drafter: a directory, or None to use `path/drafter` when it exists, or False for none. verify: check each chunk
    file of a converted checkpoint that this process reads against the sha256 its manifest records (False skips it).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {tuple(DTYPES)}")
    path = os.fspath(path)
    if not os.path.isdir(path):
        what = (
            "is a file, not a checkpoint directory" if os.path.exists(path) else "checkpoint directory does not exist"
        )
        if os.path.abspath(path) == os.path.abspath(DEFAULT_CKPT):
            what += " (the embedded pair ships in the source tree, not in a built wheel: pass --ckpt DIR)"
        raise FileNotFoundError(f"{path}: {what}")
    impls = impls or ops.Impls.auto(mesh, expert_mode)
    if _is_hf_dir(path):
        from k26jax import hf

        cfg = ModelConfig.from_hf_dir(path)
        params = place(hf.read_target(path, cfg, dtype=dtype), cfg, mesh, expert_mode)
    else:  # a converted checkpoint; restore refuses one without its COMPLETE marker
        from k26jax import checkpoint

        cfg, params = checkpoint.restore(path, mesh=mesh, expert_mode=expert_mode, dtype=dtype, verify=verify)
    model = Model(cfg, params, impls, mesh, path=path)
    log.info(
        "%s: %d layers on %s, kernels: %s", path, cfg.num_hidden_layers, jax.default_backend(), ops.kernel_path(impls)
    )
    drafter_dir = os.path.join(path, "drafter") if drafter is None else drafter
    if drafter_dir and os.path.isdir(drafter_dir):
        _attach_drafter(model, drafter_dir, dtype, verify)
    elif drafter:
        raise FileNotFoundError(f"{drafter}: drafter directory does not exist")
    return model


def _is_hf_dir(path: str) -> bool:
    """HF safetensors (not a directory made by `python -m convert`, which is marked by its COMPLETE file)."""
    from k26jax.checkpoint import COMPLETE_FILE

    if os.path.exists(os.path.join(path, COMPLETE_FILE)):
        return False
    return any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors.index.json", "model.safetensors"))


def _attach_drafter(model: Model, drafter_dir: str, dtype: str, verify: bool = True) -> None:
    """A converted drafter is restored straight onto the model's mesh (each process reads its own shards); a HF
    drafter is read on the host, cast, then placed."""
    from k26jax.model import drafter as drafter_lib

    if _is_hf_dir(drafter_dir):
        from k26jax import hf

        dcfg, dparams = hf.read_drafter(drafter_dir)
        dparams = jax.tree.map(
            lambda a: np.asarray(a, DTYPES[dtype]) if jnp.issubdtype(np.asarray(a).dtype, jnp.floating) else a, dparams
        )
        if model.mesh is not None:
            specs = drafter_lib.drafter_partition_specs(dcfg, model.mesh.shape[sharding.MODEL])
            dparams = jax.device_put(dparams, sharding.shardings_for(dparams, specs, model.mesh))
        else:
            dparams = jax.tree.map(jnp.asarray, dparams)
    else:
        from k26jax import checkpoint

        dcfg, dparams = checkpoint.restore_drafter(drafter_dir, mesh=model.mesh, dtype=dtype, verify=verify)
    dcfg.check_target(model.cfg)
    model.drafter_cfg, model.drafter_params = dcfg, dparams
