"""tree_build and tree_accept compiled on the GPU against k26jax.ddtree: the trees node for node
(`build_tree_from_topk`), the visibility, and the acceptance walk (`follow_tree`) for a target that agrees along
first children at some nodes and nowhere at others. Inputs: peaked draft logits over 8192 tokens, K = B."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k26jax import ddtree
from pallas_kernels.tree_accept import tree_accept
from pallas_kernels.tree_build import draft_topk, tree_build, visibility_from_parents

pytestmark = pytest.mark.gpu

VOCAB = 8192


def draft(seed, C, L, B):
    """(logq, ids) [C, L, B] of peaked logits: one spiked token a depth, top-1 probability ~10-99%."""
    k_noise, k_spike, k_token = jax.random.split(jax.random.key(seed), 3)
    logits = jax.random.normal(k_noise, (C, L, VOCAB))
    spike = jax.random.uniform(k_spike, (C, L, 1), minval=7.5, maxval=13.5)
    token = jax.random.randint(k_token, (C, L, 1), 0, VOCAB)
    return draft_topk(jnp.where(jnp.arange(VOCAB) == token, logits + spike, logits), B)


def target_choices(tokens, parents, num_nodes, rng):
    """post [C, B+1]: at each node, with probability 3/4 its first drafted child's token, else a token no child has."""
    C, B = tokens.shape
    post = rng.integers(VOCAB, 2 * VOCAB, (C, B + 1))
    for c in range(C):
        for child in range(num_nodes[c], 0, -1):  # highest index first: the first child is written last
            if rng.random() < 0.75:
                post[c, parents[c, child]] = tokens[c, child - 1]
    return post.astype(np.int32)


@pytest.mark.parametrize("C, B, L", [(64, 64, 7), (64, 64, 15), (8, 256, 15), (4, 16, 7), (8, 7, 7)])
def test_build_and_accept_match_ddtree(C, B, L):
    logq, ids = draft(C * 1000 + B, C, L, B)
    budgets = jnp.full((C,), B, jnp.int32).at[0].set(B // 2)
    tokens, depths, parents, num_nodes = jax.device_get(tree_build(logq, ids, budgets, max_budget=B))
    logq_host, ids_host = jax.device_get((logq, ids))
    for c in range(C):
        tree = ddtree.build_tree_from_topk(logq_host[c], ids_host[c], int(budgets[c]))
        n = tree.num_nodes
        assert num_nodes[c] == n
        np.testing.assert_array_equal(tokens[c, :n], tree.tokens[:n])
        np.testing.assert_array_equal(depths[c, :n], tree.depths[:n])
        np.testing.assert_array_equal(parents[c, : n + 1], tree.parents[: n + 1])
        visible = np.asarray(visibility_from_parents(jnp.asarray(parents[c : c + 1])))[0]
        np.testing.assert_array_equal(visible[: n + 1, : n + 1], tree.visibility[: n + 1, : n + 1])

    post = target_choices(tokens, parents, num_nodes, np.random.default_rng(B))
    path, accept_len, bonus = jax.device_get(
        tree_accept(jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(post), jnp.asarray(num_nodes), max_depth=L)
    )
    for c in range(C):
        walk, walk_bonus = ddtree.follow_tree(tokens[c], parents[c], post[c])
        assert accept_len[c] == len(walk) and bonus[c] == walk_bonus
        assert path[c, : len(walk)].tolist() == walk
