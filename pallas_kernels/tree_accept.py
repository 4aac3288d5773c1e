"""DDTree acceptance walk: Pallas-Triton kernel, jnp reference and wrapper.

From the root, repeatedly move to the drafted child whose token equals the target's choice at the
current node (argmax at T = 0, or one independent target sample per node at T > 0, which keeps the
walk lossless); stop at the first node without such a child. Siblings carry distinct tokens, so the
child is unique. Per request c:
    path [L+1] int32    accepted node indices, path[0] = 0 (root), -1 after the last accepted node
    accept_len int32    accepted nodes incl. the root = matched drafts + 1
    bonus int32         post[last accepted node], the target's next token
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _check_args(tokens, parents, post, num_nodes, max_depth):
    if tokens.ndim != 2 or tokens.dtype != jnp.int32 or tokens.shape[1] < 1:
        raise ValueError(f"tokens must be int32 [C, B] with B >= 1, got {tokens.dtype} {tokens.shape}")
    num_requests, budget = tokens.shape
    for name, array, shape in (
        ("parents", parents, (num_requests, budget + 1)),
        ("post", post, (num_requests, budget + 1)),
        ("num_nodes", num_nodes, (num_requests,)),
    ):
        if array.shape != shape or array.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 {list(shape)}, got {array.dtype} {array.shape}")
    if max_depth < 1:
        raise ValueError(f"max_depth must be >= 1, got {max_depth}")


def _tree_accept_kernel(
    num_nodes_ref, tokens_ref, parents_ref, post_ref, path_ref, accept_len_ref, bonus_ref, *, budget, max_depth
):
    """tokens_ref [C, NB] and parents_ref [C, NB+1] are padded (NB = next power of 2 >= B) so that the
    power-of-2 node loads stay inside the arrays."""
    c = pl.program_id(0)
    node_block = tokens_ref.shape[1]
    path_block = pl.next_power_of_2(max_depth + 1)
    lane = jnp.arange(node_block, dtype=jnp.int32)
    node = lane + 1  # lane l holds node l+1
    is_node = (lane < budget) & (node <= num_nodes_ref[c])
    node_token = plgpu.load(tokens_ref.at[c, pl.ds(0, node_block)], mask=is_node, other=-1)
    node_parent = plgpu.load(parents_ref.at[c, pl.ds(1, node_block)], mask=is_node, other=-1)
    path_slot = jnp.arange(path_block, dtype=jnp.int32)

    def step(carry):
        length, current, _, path = carry
        choice = post_ref[c, current]
        child = jnp.min(jnp.where((node_parent == current) & (node_token == choice), node, budget + 1))
        found = child <= budget
        path = jnp.where(found & (path_slot == length), child, path)
        return length + found.astype(jnp.int32), jnp.where(found, child, current), found, path

    init = (jnp.int32(1), jnp.int32(0), jnp.bool_(True), jnp.where(path_slot == 0, 0, -1))
    accept_len, last, _, path = jax.lax.while_loop(lambda carry: carry[2] & (carry[0] <= max_depth), step, init)
    plgpu.store(path_ref.at[c, pl.ds(0, path_block)], path, mask=path_slot <= max_depth)
    accept_len_ref[c] = accept_len
    bonus_ref[c] = post_ref[c, last]


@functools.partial(jax.jit, static_argnames=("max_depth", "interpret"))
def tree_accept(tokens, parents, post, num_nodes, *, max_depth, interpret=False):
    """Batched acceptance walk (Pallas-Triton, one program per request).

    tokens [C, B], parents [C, B+1], post [C, B+1] (target's choice per node, row 0 = root), num_nodes [C],
    all int32; max_depth = L. Returns path [C, L+1], accept_len [C], bonus [C] (module docstring).
    """
    _check_args(tokens, parents, post, num_nodes, max_depth)
    num_requests, budget = tokens.shape
    pad = ((0, 0), (0, pl.next_power_of_2(budget) - budget))
    tokens, parents = jnp.pad(tokens, pad, constant_values=-1), jnp.pad(parents, pad, constant_values=-1)
    out_shape = (
        jax.ShapeDtypeStruct((num_requests, max_depth + 1), jnp.int32),
        jax.ShapeDtypeStruct((num_requests,), jnp.int32),
        jax.ShapeDtypeStruct((num_requests,), jnp.int32),
    )
    return pl.pallas_call(
        functools.partial(_tree_accept_kernel, budget=budget, max_depth=max_depth),
        out_shape=out_shape,
        grid=(num_requests,),
        compiler_params=plgpu.CompilerParams(num_warps=1 if budget <= 256 else 4, num_stages=1),
        interpret=interpret,
        name="tree_accept",
    )(num_nodes, tokens, parents, post)


@functools.partial(jax.jit, static_argnames=("max_depth",))
def tree_accept_reference(tokens, parents, post, num_nodes, *, max_depth):
    """`tree_accept` in plain jnp, vectorized over requests (a fori_loop of max_depth steps)."""
    _check_args(tokens, parents, post, num_nodes, max_depth)
    num_requests, budget = tokens.shape
    node = jnp.arange(1, budget + 1, dtype=jnp.int32)
    node_parent = jnp.where(node <= num_nodes[:, None], parents[:, 1:], -1)

    def step(length, carry):
        current, alive, path = carry
        choice = jnp.take_along_axis(post, current[:, None], axis=1)
        is_child = (node_parent == current[:, None]) & (tokens == choice) & alive[:, None]
        found = is_child.any(axis=1)
        child = jnp.argmax(is_child, axis=1).astype(jnp.int32) + 1
        path = path.at[:, length].set(jnp.where(found, child, -1))
        return jnp.where(found, child, current), found, path

    path = jnp.full((num_requests, max_depth + 1), -1, jnp.int32).at[:, 0].set(0)
    init = (jnp.zeros(num_requests, jnp.int32), jnp.ones(num_requests, bool), path)
    last, _, path = jax.lax.fori_loop(1, max_depth + 1, step, init)
    accept_len = (path >= 0).sum(axis=1).astype(jnp.int32)
    return path, accept_len, jnp.take_along_axis(post, last[:, None], axis=1)[:, 0]
