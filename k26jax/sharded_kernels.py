"""Single-device kernels under shard_map, for ops on a multi-device mesh (ops.py passes the kernel in: this module
knows the layouts, not the kernels).

Routed experts are split over sharding.MODEL as k26jax.sharding lays them out (`expert_partition_specs`: whole
experts a device, "ep", or every expert's intermediate dim, "tp"); each shard's fp32 partial output is summed
over the axis. MLA attention is split over heads, and its batch (queries, latent cache, tail, lengths) over
sharding.DATA where the batch divides. A pallas_call inside shard_map needs check_vma=False.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from k26jax import sharding

EXPERT_LEAVES = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")


def check_mesh(mesh: Mesh):
    if sharding.MODEL not in mesh.axis_names:
        raise ValueError(f"the mesh needs a {sharding.MODEL!r} axis, got {mesh.axis_names}")


def moe_specs(mode: str, *, stacked: bool = False) -> tuple[P, ...]:
    """PartitionSpecs of (x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale) for
    `fused_moe_sharded`: activations and routing replicated, the experts as `sharding.expert_partition_specs`
    lays them out. stacked: the weights carry their leading layer axis (as in the parameter tree); else one
    layer's [E, ...]."""
    specs = sharding.expert_partition_specs(mode)
    weights = tuple(specs[leaf] if stacked else P(*specs[leaf][1:]) for leaf in EXPERT_LEAVES)
    return (P(), P(), P(), *weights)


def shard_experts(local_moe, mesh: Mesh, *, mode: str = "ep", stacked: bool = False):
    """local_moe(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, *, expert_offset, layer)
    -> fp32 partial y [M, D] of one shard's experts, run under shard_map and summed over sharding.MODEL. Returns
    f(x, ..., w2_scale[, layer]) with arguments sharded as `moe_specs(mode, stacked=)`; stacked: the weights keep
    their layer axis and f takes the layer (int32 []). Under "ep" shard s owns experts [s * E_local, ...); under
    "ep_global" s counts over ("data", "model"), the experts spanning every host, and the sum runs over both."""
    axis = (sharding.DATA, sharding.MODEL) if mode == "ep_global" else sharding.MODEL
    specs = moe_specs(mode, stacked=stacked) + ((P(),) if stacked else ())

    def per_shard(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, layer=None):
        experts_local = w13_packed.shape[1 if stacked else 0]
        offset = jax.lax.axis_index(axis) * experts_local if mode in ("ep", "ep_global") else 0
        args = (x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale)
        y = local_moe(*args, expert_offset=offset, layer=layer)
        return jax.lax.psum(y, axis).astype(x.dtype)

    return jax.shard_map(per_shard, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)


def shard_heads(attention, mesh: Mesh):
    """attention(q_lat, q_rope, cache, prefix_len, tail, visibility, *, scale, layer=None) with heads split over
    sharding.MODEL and the batch over sharding.DATA where it divides (each host attends over its own sequences'
    cache rows: no attention traffic crosses hosts); otherwise the cache, tail, lengths and visibility are
    replicated. layer is replicated."""

    def sharded_attention(q_lat, q_rope, cache, prefix_len, tail, visibility, *, scale: float, layer=None):
        num_shards = mesh.shape[sharding.MODEL]
        if q_lat.ndim != 4 or q_lat.shape[2] % num_shards:
            raise ValueError(f"q_lat heads (shape {q_lat.shape}) must divide over {num_shards} devices")
        rows = mesh.shape.get(sharding.DATA, 1)
        b = sharding.DATA if rows > 1 and q_lat.shape[0] % rows == 0 else None
        heads = P(b, None, sharding.MODEL, None)
        cache_spec = P(None, b) if cache.ndim == 4 else P(b)  # a layer stack [L, C, S, W] or one layer's [C, S, W]
        specs = [heads, heads, cache_spec, P(b), P(b), P(b)]
        args = [q_lat, q_rope, cache, prefix_len, tail, visibility]
        if layer is None:
            local = functools.partial(attention, scale=scale)
        else:
            args.append(jnp.asarray(layer, jnp.int32))
            specs.append(P())
            local = lambda *a: attention(*a[:-1], scale=scale, layer=a[-1])
        return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=heads, check_vma=False)(*args)

    return sharded_attention
