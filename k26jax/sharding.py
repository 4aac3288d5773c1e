"""The device mesh and one PartitionSpec for every parameter and cache leaf.

Mesh axes ("data", "model"): batch over "data", tensor parallelism over "model". Attention is split over heads,
embedding and lm_head over the vocabulary, dense MLPs over their intermediate dim. Routed experts are split by a
switch: "ep" puts E/n whole experts on each device, "tp" splits every expert's intermediate dim, "ep_global" puts
E/(data * model) whole experts on each device of the whole mesh. Each parameter's axes are declared beside its
shape in k26jax/model/params.py. The latent KV cache is replicated over "model" (MLA under head parallelism needs
every head to see the whole latent).

Several hosts (jax.distributed, see k26jax/distributed.py and docs/MULTIHOST.md): `make_mesh` gives each process
one row of "data", so "model" never leaves a host. With expert_mode "ep_global" the routed experts (95% of the
bytes) are split over every device of every host, while attention, the dense layers, embedding and lm_head are
split over "model" within a host and replicated across hosts; the cache's batch is split across hosts. The intent is
that only the MoE's expert combine crosses hosts; the sharded Pallas kernels still take the batch replicated (see
docs/MULTIHOST.md, "What comes next").
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k26jax.config import ModelConfig
from k26jax.model import params as param_table
from k26jax.model.params import DATA, MODEL

EXPERT_MODES = ("ep", "tp")  # the single-host layouts (what the command-line tools offer)
ALL_EXPERT_MODES = tuple(param_table.EXPERT_AXES)  # and "ep_global", for meshes over several hosts


def make_mesh(num_devices: int | None = None, *, data: int | None = None) -> Mesh:
    """A (data, n / data) ("data", "model") mesh over the first n devices (all of them by default).

    One process: data defaults to 1, so the mesh is (1, n) over the first n visible devices. Several processes
    (after k26jax.distributed.initialize): the mesh spans every process's devices, data defaults to the process
    count, and rows are whole groups of one process's devices (ordered by process, then device id), so the "model"
    axis, and with it tensor parallelism, stays inside a host. num_devices must then be all of them.
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    n = len(devices) if num_devices is None else num_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"num_devices={num_devices}: {len(devices)} device(s) visible")
    processes = jax.process_count()
    if processes > 1 and n != len(devices):
        raise ValueError(f"num_devices={num_devices}: a mesh over {processes} processes takes all {len(devices)}")
    data = processes if data is None else data
    if data < 1 or n % data:
        raise ValueError(f"data={data}: must divide the {n} devices")
    grid = np.asarray(devices[:n], dtype=object).reshape(data, n // data)
    for row in grid:
        if len({d.process_index for d in row}) > 1:
            raise ValueError(
                f"data={data}: a row of {n // data} devices would span processes "
                f'{sorted({d.process_index for d in row})}; the "model" axis must stay within one host'
            )
    return Mesh(grid, (DATA, MODEL))


def expert_partition_specs(expert_mode: str = "ep") -> dict:
    """PartitionSpecs of the stacked routed-expert leaves (w13_packed, w13_scale [n, E, D/g, 2, Im], w2_packed,
    w2_scale [n, E, Im/g, D]) for the sharded MoE kernels (sharded_kernels.moe_specs): "ep" splits the experts,
    "tp" the intermediate dim Im (gate/up pairs stay whole), "ep_global" the experts over ("data", "model")."""
    _check_mode(expert_mode)
    return {name: P(None, *axes) for name, axes in param_table.EXPERT_AXES[expert_mode].items()}


def param_partition_specs(cfg: ModelConfig, expert_mode: str = "ep") -> dict:
    """PartitionSpecs mirroring the parameter tree (declared in k26jax/model/params.py)."""
    _check_mode(expert_mode)
    return param_table.partition_specs(param_table.target_table(cfg), expert_mode)


def _check_mode(expert_mode: str) -> None:
    if expert_mode not in ALL_EXPERT_MODES:
        raise ValueError(f"expert_mode={expert_mode!r}: use one of {ALL_EXPERT_MODES}")


def cache_partition_spec() -> P:
    """Latent cache [layers, C, S_max, R+Dr]: batch over "data", replicated over "model"."""
    return P(None, DATA, None, None)


def fit_spec(spec: P, shape: tuple[int, ...], mesh: Mesh) -> P:
    """Drop mesh axes from dims they do not divide (e.g. 4 heads on an 8-way model axis): replicate instead. A dim
    split over several axes (("data", "model")) keeps those of size > 1 (a bare name when one is left), or is
    replicated when their product does not divide it."""
    axes = []
    for dim, axis in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        if isinstance(axis, tuple):
            axis = tuple(a for a in axis if mesh.shape[a] > 1)
            axis = None if not axis else axis[0] if len(axis) == 1 else axis
        size = 1 if axis is None else math.prod(mesh.shape[a] for a in (axis if isinstance(axis, tuple) else (axis,)))
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
