"""The single-device kernels of pallas_kernels under shard_map, for ops on a multi-device mesh.

Routed experts are split over sharding.MODEL as k26jax.sharding lays them out (`expert_partition_specs`: whole
experts a device, "ep", or every expert's intermediate dim, "tp"); each shard's fp32 partial output is summed
over the axis. MLA attention is split over heads; the latent cache, tail and lengths are replicated. A pallas_call
inside shard_map needs check_vma=False.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from k26jax import sharding
from pallas_kernels import int4_moe_gemm
from pallas_kernels import tree_mla_attention as mla_kernel

EXPERT_LEAVES = ("w13_packed", "w13_scale", "w2_packed", "w2_scale")
IMPLS = ("pallas", "reference")


def _check(mesh: Mesh, impl: str):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
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


def fused_moe_sharded(mesh: Mesh, *, mode="ep", impl="pallas", interpret=False, tiling=None, stacked=False):
    """int4_moe_gemm.fused_moe (or its reference) under shard_map. Returns f(x, topk_ids, topk_weights,
    w13_packed, w13_scale, w2_packed, w2_scale) -> y [M, D], arguments sharded as `moe_specs(mode, stacked=)`
    says. stacked: the weights are stacked per layer ([n, E, ...]) and f takes a further argument, the layer
    (int32 []). Under "ep" shard s owns experts [s * E_local, (s + 1) * E_local)."""
    _check(mesh, impl)
    axis = sharding.MODEL
    specs = moe_specs(mode, stacked=stacked) + ((P(),) if stacked else ())

    def local_moe(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, layer=None):
        experts_local = w13_packed.shape[1 if stacked else 0]
        offset = jax.lax.axis_index(axis) * experts_local if mode == "ep" else 0
        args = (x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale)
        if impl == "pallas":
            y = int4_moe_gemm.fused_moe(
                *args,
                expert_offset=offset,
                tiling=tiling,
                out_dtype=jnp.float32,
                pair_rows_fp32=mode == "tp",
                interpret=interpret,
                layer=layer,
            )
        else:
            y = int4_moe_gemm.fused_moe_reference(*args, expert_offset=offset, out_dtype=jnp.float32, layer=layer)
        return jax.lax.psum(y, axis).astype(x.dtype)

    return jax.shard_map(local_moe, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)


def tree_mla_attention_sharded(mesh: Mesh, *, impl: str = "pallas", interpret: bool = False, **block_knobs):
    """Returns f(q_lat, q_rope, cache, prefix_len, tail, visibility, *, scale, layer=None): tree_mla_attention
    (or its reference) with heads split over sharding.MODEL; the latent cache (or its layer stack), tail,
    lengths, visibility and layer are replicated."""
    _check(mesh, impl)
    if impl == "pallas":
        attention = functools.partial(mla_kernel.tree_mla_attention, interpret=interpret, **block_knobs)
    elif block_knobs:
        raise ValueError(f"block knobs {sorted(block_knobs)} apply only to impl='pallas'")
    else:
        attention = mla_kernel.tree_mla_attention_reference
    heads = P(None, None, sharding.MODEL, None)

    def sharded_attention(q_lat, q_rope, cache, prefix_len, tail, visibility, *, scale: float, layer=None):
        num_shards = mesh.shape[sharding.MODEL]
        if q_lat.ndim != 4 or q_lat.shape[2] % num_shards:
            raise ValueError(f"q_lat heads (shape {q_lat.shape}) must divide over {num_shards} devices")
        args = (q_lat, q_rope, cache, prefix_len, tail, visibility)
        if layer is None:
            local = functools.partial(attention, scale=scale)
        else:
            args += (jnp.asarray(layer, jnp.int32),)
            local = lambda *a: attention(*a[:-1], scale=scale, layer=a[-1])
        return jax.shard_map(
            local, mesh=mesh, in_specs=(heads, heads) + (P(),) * (len(args) - 2), out_specs=heads, check_vma=False
        )(*args)

    return sharded_attention
