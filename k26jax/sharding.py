"""The device mesh and one PartitionSpec for every parameter and cache leaf.

Mesh axes ("data", "model"): batch over "data", tensor parallelism over "model". Attention is split over heads,
embedding and lm_head over the vocabulary, dense MLPs over their intermediate dim. Routed experts are split by a
switch: "ep" puts E/n whole experts on each device, "tp" splits every expert's intermediate dim. The latent KV
cache is replicated over "model" (MLA under head parallelism needs every head to see the whole latent).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from k26jax.config import ModelConfig

DATA, MODEL = "data", "model"
EXPERT_MODES = ("ep", "tp")


def make_mesh(num_devices: int | None = None) -> Mesh:
    """A (1, n) ("data", "model") mesh over the first n visible devices (all of them by default)."""
    devices = jax.devices()
    n = len(devices) if num_devices is None else num_devices
    if not 1 <= n <= len(devices):
        raise ValueError(f"num_devices={num_devices}: {len(devices)} device(s) visible")
    return Mesh(np.asarray(devices[:n]).reshape(1, n), (DATA, MODEL))


def _attn_specs(cfg: ModelConfig) -> dict:
    specs = {
        "kv_a": P(None, None, None),
        "kv_a_norm": P(None, None),
        "w_uk": P(None, MODEL, None, None),
        "w_uv": P(None, MODEL, None, None),
        "o": P(None, MODEL, None, None),
    }
    if cfg.q_lora_rank is None:
        specs["q"] = P(None, None, MODEL, None)
    else:
        specs.update(q_a=P(None, None, None), q_a_norm=P(None, None), q_b=P(None, None, MODEL, None))
    return specs


def _mlp_specs() -> dict:
    return {"gate_up": P(None, None, None, MODEL), "down": P(None, MODEL, None)}


def expert_partition_specs(expert_mode: str = "ep") -> dict:
    """PartitionSpecs of the stacked routed-expert leaves (w13_packed, w13_scale [n, E, D/g, 2, Im], w2_packed,
    w2_scale [n, E, Im/g, D]): "ep" splits the experts, "tp" the intermediate dim Im (gate/up pairs stay whole)."""
    if expert_mode not in EXPERT_MODES:
        raise ValueError(f"expert_mode={expert_mode!r}: use one of {EXPERT_MODES}")
    if expert_mode == "ep":
        e = P(None, MODEL, None, None, None)
        return {
            "w13_packed": e,
            "w13_scale": e,
            "w2_packed": P(None, MODEL, None, None),
            "w2_scale": P(None, MODEL, None, None),
        }
    i = P(None, None, None, None, MODEL)
    return {
        "w13_packed": i,
        "w13_scale": i,
        "w2_packed": P(None, None, MODEL, None),
        "w2_scale": P(None, None, MODEL, None),
    }


def param_partition_specs(cfg: ModelConfig, expert_mode: str = "ep") -> dict:
    """PartitionSpecs mirroring the parameter tree (see k26jax/model/target.py)."""
    if expert_mode not in EXPERT_MODES:
        raise ValueError(f"expert_mode={expert_mode!r}: use one of {EXPERT_MODES}")
    tree = {"embed": P(MODEL, None), "final_norm": P(None), "lm_head": P(None, MODEL)}
    for kind, n in (("dense", cfg.num_dense_layers), ("moe", cfg.num_moe_layers)):
        if not n:
            continue
        layer = {"input_norm": P(None, None), "post_attn_norm": P(None, None), "attn": _attn_specs(cfg)}
        if kind == "dense":
            layer["mlp"] = _mlp_specs()
        else:
            mlp = {
                "router_kernel": P(None, None, None),
                "router_bias": P(None, None),
                **expert_partition_specs(expert_mode),
            }
            if cfg.n_shared_experts:
                mlp["shared"] = _mlp_specs()
            layer["mlp"] = mlp
        tree[kind] = layer
    return tree


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
