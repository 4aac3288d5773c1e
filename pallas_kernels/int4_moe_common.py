"""What both fused-MoE backends (int4_moe_gemm's Triton kernels, int4_moe_mosaic's Mosaic GPU kernels) share:
the INT4 weight layout and its checks, per-layer weight stacks read in place, and expert routing without a sort.

Layout (compressed-tensors pack-quantized, transposed to K-major with N contiguous):
    w13_packed [E, D/8, 2, I] int32   w13_scale [E, D/32, 2, I] bf16   ('2' axis: 0 = gate, 1 = up)
    w2_packed  [E, I/8, D]    int32   w2_scale  [E, I/32, D]    bf16
Each int32 word holds 8 offset-binary nibbles along K, LSB first: input row 8j+k is nibble k of word j,
and its value is q = nibble - 8 in [-8, 7].
"""

import jax.numpy as jnp

GROUP = 32  # input rows per scale
PACK = 8  # nibbles per int32 word


def check_args(x, topk_ids, topk_weights, w13_packed, w13_scale, w2_packed, w2_scale):
    """Validates shapes/dtypes; returns (E, D, I)."""
    if x.ndim != 2:
        raise ValueError(f"x must be [M, D], got shape {x.shape}")
    m, d = x.shape
    if topk_ids.ndim != 2 or topk_ids.shape[0] != m or not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise ValueError(f"topk_ids must be integer [M={m}, k], got {topk_ids.shape} {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights shape {topk_weights.shape} != topk_ids shape {topk_ids.shape}")
    if w13_packed.ndim != 4 or w13_packed.shape[1:3] != (d // PACK, 2) or w13_packed.dtype != jnp.int32:
        raise ValueError(
            f"w13_packed must be int32 [E, D/8={d // PACK}, 2, I], got {w13_packed.shape} {w13_packed.dtype}"
        )
    e, _, _, i = w13_packed.shape
    if d % GROUP or i % GROUP:
        raise ValueError(f"D={d} and I={i} must be multiples of {GROUP}")
    if w13_scale.shape != (e, d // GROUP, 2, i):
        raise ValueError(f"w13_scale must be [E, D/32, 2, I]={(e, d // GROUP, 2, i)}, got {w13_scale.shape}")
    if w2_packed.shape != (e, i // PACK, d) or w2_packed.dtype != jnp.int32:
        raise ValueError(
            f"w2_packed must be int32 [E, I/8, D]={(e, i // PACK, d)}, got {w2_packed.shape} {w2_packed.dtype}"
        )
    if w2_scale.shape != (e, i // GROUP, d):
        raise ValueError(f"w2_scale must be [E, I/32, D]={(e, i // GROUP, d)}, got {w2_scale.shape}")
    return e, d, i


def flatten_layers(weights, layer):
    """Weights stacked per layer ([n, E, ...] each) -> ([n*E, ...] views (a free reshape), E, first row of
    `layer`); unstacked (layer None) -> (weights, E, 0). Kernels index the layer inside the stack, so no
    per-layer copy of the experts is made, as slicing the stack in front of a custom call would."""
    if layer is None:
        return weights, weights[0].shape[0], 0
    num_layers, per_layer = weights[0].shape[:2]
    if any(w.shape[:2] != (num_layers, per_layer) for w in weights):
        raise ValueError(f"stacked weights must share their leading [n, E] dims, got {[w.shape for w in weights]}")
    return tuple(w.reshape((num_layers * per_layer,) + w.shape[2:]) for w in weights), per_layer, layer * per_layer


def exclusive_prefix_sum(values):
    """values [n, ...] -> [n, ...]: at i the sum of values[:i], as one fused compare-and-sum over [n, n, ...]
    (XLA turns jnp.cumsum into a blocked scan of several kernels, each a launch on the GPU)."""
    n = values.shape[0]
    before = (jnp.arange(n)[None, :] < jnp.arange(n)[:, None]).reshape(n, n, *[1] * (values.ndim - 1))
    return jnp.sum(jnp.where(before, values[None], 0), axis=1, dtype=values.dtype)


def expert_ranks(local_ids, num_experts, chunk=1024):
    """local_ids [P] int32 (outside [0, E) = not on this shard) -> (counts [E] int32: pairs of each expert,
    rank [P] int32: pairs q < p with p's expert; off-shard pairs are ranked among themselves).

    No sort: per chunk of pairs, one fused compare-and-sum counts the experts and another ranks each pair
    within its chunk (O(P * (E + chunk)) work), and the chunks' counts are carried by a prefix sum. A stable
    argsort by expert puts pair p at its expert's first position + rank[p], so this is that order.
    """
    num_pairs = local_ids.shape[0]
    chunk = max(1, min(chunk, num_pairs))
    num_chunks = -(-num_pairs // chunk)
    key = jnp.where((local_ids >= 0) & (local_ids < num_experts), local_ids, num_experts)
    key = jnp.pad(key, (0, num_chunks * chunk - num_pairs), constant_values=num_experts + 1).reshape(num_chunks, chunk)
    chunk_counts = jnp.sum(key[:, :, None] == jnp.arange(num_experts + 1), axis=1, dtype=jnp.int32)  # [n, E + 1]
    before = exclusive_prefix_sum(chunk_counts)
    earlier = jnp.arange(chunk)[None, :] < jnp.arange(chunk)[:, None]  # [p, q]: q before p
    within = jnp.sum((key[:, :, None] == key[:, None, :]) & earlier, axis=2, dtype=jnp.int32)  # [n, chunk]
    rank = jnp.take_along_axis(before, jnp.minimum(key, num_experts), axis=1) + within
    return chunk_counts[:, :num_experts].sum(axis=0), rank.reshape(-1)[:num_pairs]


def group_starts(counts, multiple):
    """[E] first row of each expert's group when the groups follow each other padded to `multiple` rows."""
    return exclusive_prefix_sum(-(-counts // multiple) * multiple)


def pair_rows(local_ids, starts, rank, off_shard):
    """[P] int32: the row of each pair in the experts' padded groups (its group's first row + its rank),
    `off_shard` for pairs outside [0, E). starts [E]: `group_starts`; rank: `expert_ranks`."""
    num_experts = starts.shape[0]
    on_shard = (local_ids >= 0) & (local_ids < num_experts)
    return jnp.where(on_shard, starts[jnp.clip(local_ids, 0, num_experts - 1)] + rank, off_shard)


def block_experts(counts, block_m, num_blocks):
    """[num_blocks] int32: the expert of each block_m-row block of the padded groups, -1 past the last."""
    blocks = -(-counts // block_m)
    block_end = exclusive_prefix_sum(blocks) + blocks
    expert = jnp.sum(block_end[None, :] <= jnp.arange(num_blocks)[:, None], axis=1, dtype=jnp.int32)
    return jnp.where(expert < counts.shape[0], expert, -1)


def max_blocks(num_pairs, num_experts, block_m):
    """Static bound on the row blocks: each touched expert adds < 1 partial block."""
    return num_pairs // block_m + min(num_experts, num_pairs)
