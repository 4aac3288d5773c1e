"""The device mesh and one PartitionSpec for every parameter and cache leaf.

Mesh axes ("data", "model"): batch over "data", tensor parallelism over "model". Attention is split over heads,
embedding and lm_head over the vocabulary, dense MLPs over their intermediate dim. Routed experts are split by a
switch: "ep" puts E/n whole experts on each device, "tp" splits every expert's intermediate dim. Each parameter's
axes are declared beside its shape in k26jax/model/params.py. The latent KV cache is replicated over "model"
(MLA under head parallelism needs every head to see the whole latent).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k26jax.config import ModelConfig
from k26jax.model import params as param_table
from k26jax.model.params import DATA, MODEL

EXPERT_MODES = tuple(param_table.EXPERT_AXES)


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A (1, n) ("data", "model") mesh over the first n visible devices (all of them by default)."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"num_devices={num_devices}: {len(devices)} device(s) visible")
    return Mesh(np.asarray(devices[:n]).reshape(1, n), (DATA, MODEL))


def expert_partition_specs(expert_mode: str = "ep") -> dict:
    """PartitionSpecs of the stacked routed-expert leaves (w13_packed, w13_scale [n, E, D/g, 2, Im], w2_packed,
    w2_scale [n, E, Im/g, D]): "ep" splits the experts, "tp" the intermediate dim Im (gate/up pairs stay whole)."""
    _check_mode(expert_mode)
    return {name: P(None, *axes) for name, axes in param_table.EXPERT_AXES[expert_mode].items()}


def param_partition_specs(cfg: ModelConfig, expert_mode: str = "ep") -> dict:
    """PartitionSpecs mirroring the parameter tree (declared in k26jax/model/params.py)."""
    _check_mode(expert_mode)
    return param_table.partition_specs(param_table.target_table(cfg), expert_mode)


def _check_mode(expert_mode: str) -> None:
    if expert_mode not in EXPERT_MODES:
        raise ValueError(f"expert_mode={expert_mode!r}: use one of {EXPERT_MODES}")


def cache_partition_spec() -> P:
    """Latent cache [layers, C, S_max, R+Dr]: batch over "data", replicated over "model"."""
    return P(None, DATA, None, None)


def fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """Drop mesh axes from dims they do not divide (e.g. 4 heads on an 8-way model axis): replicate instead."""
    axes = []
    for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        size = 1 if axis is None else mesh.shape[axis]
        axes.append(axis if axis is None or dim % size == 0 else None)
    return P(*axes)


def shardings_for(tree_of_arrays, specs, mesh: Mesh):
    """NamedShardings for a tree of arrays (or ShapeDtypeStructs), fitted to the mesh."""
    return jax.tree.map(
        lambda s, x: NamedSharding(mesh, fit_spec(s, x.shape, mesh)),
        specs,
        tree_of_arrays,
        is_leaf=lambda x: isinstance(x, P),
    )
