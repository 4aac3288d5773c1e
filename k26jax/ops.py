"""The one door from the model and the engine to the kernels of pallas_kernels.

Each op picks `impl="pallas"` (the GPU kernels) or `impl="reference"` (plain jnp). On a multi-device mesh the
Pallas forms of the MoE and the attention run under shard_map (k26jax/sharded_kernels.py); the reference forms
are left to XLA's SPMD partitioner. No math lives here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from k26jax import sharded_kernels
from pallas_kernels import arch, few_row_gemm, int4_moe_gemm
from pallas_kernels import tree_accept as tree_accept_kernel
from pallas_kernels import tree_build as tree_build_kernel
from pallas_kernels import tree_mla_attention as mla_kernel

IMPLS = ("pallas", "reference")
SKIP = "skip"  # Impls.moe / Impls.attention only: the op returns its input (benchmark phase ablations)

# What XLA GPU would otherwise copy every step:
# - a layer scan slices each layer's weights out of their stack, and its Triton dot fusions cannot read that
#   slice in place; with dynamic-slice fusion and cuBLAS dots each dot reads it where it lies;
# - the dot merger concatenates the weights of dots that share an input (q_a with kv_a, the drafter's q, k, v)
#   into a new array; a 0 MB threshold turns it off.
SLICE_IN_PLACE = {"xla_gpu_enable_dynamic_slice_fusion": True, "xla_gpu_enable_triton_gemm": False}
NO_DOT_MERGER = {"xla_gpu_dot_merger_threshold_mb": 0}
# For jax.jit(compiler_options=) of anything that runs the model. cuBLAS is slow at 1 row, so the model pads its
# dense dots to layers.GPU_MIN_ROWS rows.
COMPILER_OPTIONS = {**NO_DOT_MERGER, **SLICE_IN_PLACE}


@dataclasses.dataclass(frozen=True)
class Impls:
    """Which implementation each op uses; hashable, so it can be a static jit argument.

    moe and attention also take "skip" for benchmark phase ablations: `moe_gemm` then returns x_ND and
    `mla_attention` q_lat, with no kernel, so a step's time can be taken apart phase by phase. probe: a
    k26jax.routing.ExpertProbe that every `moe_gemm` reports its layer's expert ids to (a measurement build).
    dense_rows: a layer's dense dots of at most this many rows run as `dense_gemm`'s kernel (0: never, cuBLAS).
    """

    moe: str = "reference"
    attention: str = "reference"
    tree_build: str = "reference"
    tree_accept: str = "reference"
    mesh: Mesh | None = None
    expert_mode: str = "ep"
    interpret: bool = False
    probe: object | None = None
    dense_rows: int = 0

    def __post_init__(self):
        for field in ("moe", "attention", "tree_build", "tree_accept"):
            allowed = IMPLS + (SKIP,) if field in ("moe", "attention") else IMPLS
            if getattr(self, field) not in allowed:
                raise ValueError(f"Impls.{field}={getattr(self, field)!r}: use one of {allowed}")
        if not 0 <= self.dense_rows <= few_row_gemm.MAX_ROWS:
            raise ValueError(f"Impls.dense_rows={self.dense_rows}: use 0 to {few_row_gemm.MAX_ROWS}")

    @classmethod
    def auto(cls, mesh: Mesh | None = None, expert_mode: str = "ep") -> "Impls":
        """Pallas kernels on the GPU (dense dots of up to few_row_gemm.MAX_ROWS rows too), plain jnp elsewhere."""
        gpu = jax.default_backend() == "gpu"
        impl = "pallas" if gpu else "reference"
        dense_rows = few_row_gemm.MAX_ROWS if gpu else 0
        return cls(impl, impl, impl, impl, mesh=mesh, expert_mode=expert_mode, dense_rows=dense_rows)

    @property
    def sharded(self) -> bool:
        return self.mesh is not None and self.mesh.size > 1


def moe_gemm(x_ND, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale, *, layer, impls: Impls):
    """Routed INT4 experts of MoE layer `layer`: y [N,D] = sum_k w_k * expert_k(x).

    The weights are the whole per-layer stacks ([n, E, ...]): the kernel indexes the layer itself, because a
    slice in front of a custom call would copy ~9.5 GB of experts per K2.6 layer. See int4_moe_gemm.py.
    """
    if impls.probe is not None:
        jax.debug.callback(impls.probe.record, layer, topk_ids)
    if impls.moe == SKIP:
        return x_ND
    args = (x_ND, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale)
    with jax.named_scope("moe"):
        if impls.moe == "reference":
            return int4_moe_gemm.fused_moe_reference(*args, layer=layer)
        if impls.sharded:
            return fused_moe_sharded(
                impls.mesh, mode=impls.expert_mode, impl="pallas", interpret=impls.interpret, stacked=True
            )(*args, layer)
        return int4_moe_gemm.fused_moe(*args, interpret=impls.interpret, layer=layer)


@dataclasses.dataclass(frozen=True)
class LayerWeight:
    """Layer `layer` of the weight stack `stack` [L, ...], as a layer scan hands its dense weights to layers.mm:
    `dense_gemm` reads the layer where it lies (a slice in front of a custom call would be copied); every other
    dot takes `get()`: `sliced`, the scan's own slice of the stack (offset by the scan's counter, the form that
    cuBLAS's dynamic-slice fusion reads in place; a slice at `layer`, read from an array, is slower), or else a
    slice at `layer`."""

    stack: jax.Array
    layer: jax.Array | int
    impls: Impls
    sliced: jax.Array | None = None

    def get(self):
        if self.sliced is not None:
            return self.sliced
        return jax.lax.dynamic_index_in_dim(self.stack, self.layer, axis=0, keepdims=False)


def dense_gemm(x_MK, w_KN: LayerWeight, out_dtype):
    """x [M, K] @ layer `w_KN.layer` of the stack [L, K, N] with fp32 sums, or None where XLA's dot (cuBLAS)
    should run it: more rows than `Impls.dense_rows`, a sharded mesh (the kernel is not partitioned), or a stack
    too large for the kernel's offsets. See pallas_kernels/few_row_gemm.py."""
    impls = w_KN.impls
    if x_MK.shape[0] > impls.dense_rows or impls.sharded or w_KN.stack.size >= few_row_gemm.MAX_ELEMENTS:
        return None
    with jax.named_scope("dense_gemm"):
        return few_row_gemm.few_row_gemm(
            x_MK, w_KN.stack, layer=w_KN.layer, out_dtype=out_dtype, interpret=impls.interpret
        )


def mla_attention(q_lat, q_rope, cache, prefix_len, tail_rows, visibility, *, scale: float, layer, impls: Impls):
    """Absorbed MLA of layer `layer` over its latent-cache prefix plus a tree tail.

    cache is the whole stack [L, C, S_max, R + P]: the kernels read the layer inside it, because a slice in
    front of a custom call would copy the layer's cache (C * S_max * 1152 bytes) every layer of every step.
    See pallas_kernels/tree_mla_attention.py.
    """
    if impls.attention == SKIP:
        return q_lat
    args = (q_lat, q_rope, cache, prefix_len, tail_rows, visibility)
    with jax.named_scope("attention"):
        if impls.attention == "reference":
            return mla_kernel.tree_mla_attention_reference(*args, scale=scale, layer=layer)
        if impls.sharded:
            return tree_mla_attention_sharded(impls.mesh, impl="pallas", interpret=impls.interpret)(
                *args, scale=scale, layer=layer
            )
        return mla_kernel.tree_mla_attention(*args, scale=scale, layer=layer, interpret=impls.interpret)


def fused_moe_sharded(mesh: Mesh, *, mode="ep", impl="pallas", interpret=False, tiling=None, stacked=False):
    """int4_moe_gemm.fused_moe (or its reference) over the experts of each device: see
    sharded_kernels.shard_experts for the layout and the returned function."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    sharded_kernels.check_mesh(mesh)
    if impl == "pallas":
        local = functools.partial(
            int4_moe_gemm.fused_moe,
            tiling=tiling,
            out_dtype=jnp.float32,
            pair_rows_fp32=mode == "tp",
            interpret=interpret,
        )
    else:
        local = functools.partial(int4_moe_gemm.fused_moe_reference, out_dtype=jnp.float32)
    return sharded_kernels.shard_experts(local, mesh, mode=mode, stacked=stacked)


def tree_mla_attention_sharded(mesh: Mesh, *, impl: str = "pallas", interpret: bool = False, **block_knobs):
    """tree_mla_attention (or its reference) with heads split over the mesh: see sharded_kernels.shard_heads."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    sharded_kernels.check_mesh(mesh)
    if impl == "pallas":
        attention = functools.partial(mla_kernel.tree_mla_attention, interpret=interpret, **block_knobs)
    elif block_knobs:
        raise ValueError(f"block knobs {sorted(block_knobs)} apply only to impl='pallas'")
    else:
        attention = mla_kernel.tree_mla_attention_reference
    return sharded_kernels.shard_heads(attention, mesh)


def kernel_path(impls: Impls) -> str:
    """Which kernels the ops run, in words: "reference (jnp)", or the Pallas backends this GPU takes."""
    if impls.attention != "pallas" and impls.moe != "pallas":
        return "reference (jnp)"
    backend = "Pallas Mosaic GPU + Triton (Hopper)" if arch.has_wgmma() else "Pallas Triton"
    return backend + (" under shard_map" if impls.sharded else "")


def draft_topk(draft_logits_CLV, k: int):
    """Top-k of each depth's draft logits (XLA): (logq [C, L, k] float32 log-softmax over the full vocab,
    ids [C, L, k] int32), the inputs of `tree_build`. See pallas_kernels/tree_build.py."""
    return tree_build_kernel.draft_topk(draft_logits_CLV, k)


def tree_build(logq, ids, budgets, *, max_budget: int, impls: Impls, **knobs):
    """Best-first draft tree from per-depth top-K. See pallas_kernels/tree_build.py."""
    if impls.tree_build == "reference":
        return tree_build_kernel.tree_build_reference(logq, ids, budgets, max_budget=max_budget, **knobs)
    return tree_build_kernel.tree_build(logq, ids, budgets, max_budget=max_budget, interpret=impls.interpret, **knobs)


def visibility_from_parents(parents, *, max_depth: int | None = None):
    """parents [C, B+1] (-1 = root or padding) -> the tree mask [C, B+1, B+1] bool (XLA): each node sees itself
    and its ancestors. See pallas_kernels/tree_build.py."""
    return tree_build_kernel.visibility_from_parents(parents, max_depth=max_depth)


def tree_accept(tokens, parents, post, num_nodes, *, max_depth: int, impls: Impls):
    """Longest path whose tokens match the target's choices. See pallas_kernels/tree_accept.py."""
    if impls.tree_accept == "reference":
        return tree_accept_kernel.tree_accept_reference(tokens, parents, post, num_nodes, max_depth=max_depth)
    return tree_accept_kernel.tree_accept(
        tokens, parents, post, num_nodes, max_depth=max_depth, interpret=impls.interpret
    )
