"""tree_build / tree_accept Pallas kernels (interpret mode) against the XLA references and k26jax.ddtree.

Shapes are bucketed: a few compiled shapes serve many cases. Smaller trees are carved out of a bucket by
setting logq to -inf past a request's own depth L_c and vocabulary V_c, which the build treats exactly
like a shorter [L_c, V_c] input (zero-probability candidates are never pushed).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import triton as plgpu
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from k26jax import ddtree
from pallas_kernels.tree_accept import tree_accept, tree_accept_reference
from pallas_kernels.tree_build import draft_topk, tree_build, tree_build_reference, visibility_from_parents

H200 = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
)

# (C, L, V = K, B): the main bucket, the largest budget, and the smallest tree.
MAIN, LARGE, TINY = (4, 16, 64, 64), (2, 8, 512, 512), (3, 1, 1, 1)


def make_inputs(seed, bucket, budgets, depths, vocabs, tied):
    """Draft logits for a bucket -> (logq, ids) via draft_topk, with request c cut to depths[c] x vocabs[c]."""
    num_requests, num_depths, vocab, _ = bucket
    rng = np.random.default_rng(seed)
    if tied:
        logits = rng.integers(0, 3, (num_requests, num_depths, vocab)).astype(np.float32)
    else:
        logits = (rng.standard_normal((num_requests, num_depths, vocab)) * 3).astype(np.float32)
    logits[np.broadcast_to(np.arange(vocab) >= np.asarray(vocabs)[:, None, None], logits.shape)] = -np.inf
    logq, ids = draft_topk(jnp.asarray(logits), vocab)
    beyond_depth = np.arange(num_depths)[None, :] >= np.asarray(depths)[:, None]
    logq = jnp.where(jnp.asarray(beyond_depth)[:, :, None], -jnp.inf, logq)
    return logq, ids, jnp.asarray(budgets, jnp.int32)


def reference_trees(logq, ids, budgets, depths, vocabs, max_budget, **knobs):
    """k26jax.ddtree on each request's own [L_c, V_c] slice of the kernel's inputs, padded to max_budget."""
    trees = []
    for c, (budget, depth, vocab) in enumerate(zip(budgets, depths, vocabs)):
        tree = ddtree.build_tree_from_topk(
            np.asarray(logq[c, :depth, :vocab]), np.asarray(ids[c, :depth, :vocab]), int(budget), **knobs
        )
        pad = max_budget - int(budget)
        trees.append(
            (
                np.pad(tree.tokens, (0, pad), constant_values=-1),
                np.pad(tree.depths, (0, pad), constant_values=-1),
                np.pad(tree.parents, (0, pad), constant_values=-1),
                tree.num_nodes,
                tree,
            )
        )
    return trees


def check_build(logq, ids, budgets, depths, vocabs, max_budget, **knobs):
    kernel = jax.device_get(tree_build(logq, ids, budgets, max_budget=max_budget, interpret=True, **knobs))
    xla = jax.device_get(tree_build_reference(logq, ids, budgets, max_budget=max_budget, **knobs))
    for out in (kernel, xla):
        for c, (tokens, depths_c, parents, num_nodes, _) in enumerate(
            reference_trees(logq, ids, budgets, depths, vocabs, max_budget, **knobs)
        ):
            np.testing.assert_array_equal(out[0][c], tokens)
            np.testing.assert_array_equal(out[1][c], depths_c)
            np.testing.assert_array_equal(out[2][c], parents)
            assert out[3][c] == num_nodes
    parents = kernel[2]
    assert ((parents[:, 1:] < np.arange(1, max_budget + 1)) | (parents[:, 1:] == -1)).all()
    return kernel


def request_shapes(bucket):
    num_requests, num_depths, vocab, max_budget = bucket
    return st.tuples(
        st.lists(st.integers(0, max_budget), min_size=num_requests, max_size=num_requests),
        st.lists(st.integers(1, num_depths), min_size=num_requests, max_size=num_requests),
        st.lists(st.integers(1, vocab), min_size=num_requests, max_size=num_requests),
    )


@settings(derandomize=True, max_examples=24, deadline=None)
@given(seed=st.integers(0, 2**31), shapes=request_shapes(MAIN), tied=st.booleans())
def test_build_matches_reference(seed, shapes, tied):
    budgets, depths, vocabs = shapes
    logq, ids, budgets_arr = make_inputs(seed, MAIN, budgets, depths, vocabs, tied)
    kernel = check_build(logq, ids, budgets_arr, depths, vocabs, MAIN[3])
    np.testing.assert_array_equal(
        np.asarray(visibility_from_parents(jnp.asarray(kernel[2]), max_depth=MAIN[1])),
        np.stack([ddtree.visibility_from_parents(p) for p in kernel[2]]),
    )


def test_build_possible_nodes_below_budget_and_l1():
    # L=2, V=3 has 3 + 9 = 12 possible nodes; L=1 has V nodes
    budgets, depths, vocabs = [64, 64, 5, 64], [2, 1, 1, 16], [3, 40, 40, 1]
    logq, ids, budgets_arr = make_inputs(5, MAIN, budgets, depths, vocabs, tied=False)
    kernel = check_build(logq, ids, budgets_arr, depths, vocabs, MAIN[3])
    assert kernel[3].tolist() == [12, 40, 5, 16]


def test_build_largest_budget():
    budgets, depths, vocabs = [512, 333], [8, 5], [512, 100]
    for seed, tied in ((0, False), (1, True)):
        logq, ids, budgets_arr = make_inputs(seed, LARGE, budgets, depths, vocabs, tied)
        check_build(logq, ids, budgets_arr, depths, vocabs, LARGE[3])


def test_build_smallest():
    logq, ids, budgets_arr = make_inputs(0, TINY, [1, 0, 1], [1, 1, 1], [1, 1, 1], tied=False)
    kernel = check_build(logq, ids, budgets_arr, [1, 1, 1], [1, 1, 1], TINY[3])
    assert kernel[2].tolist() == [[-1, 0], [-1, -1], [-1, 0]]


@pytest.mark.parametrize("knobs", [dict(max_topk=3), dict(depth_bonus=0.3), dict(max_topk=2, depth_bonus=1.0)])
def test_build_knobs(knobs):
    bucket = (2, 8, 32, 32)
    budgets, depths, vocabs = [32, 17], [8, 6], [32, 20]
    for seed, tied in ((0, False), (1, True)):
        logq, ids, budgets_arr = make_inputs(seed, bucket, budgets, depths, vocabs, tied)
        check_build(logq, ids, budgets_arr, depths, vocabs, bucket[3], **knobs)


# L=2, K=2, logq [[a0, a1], [b0, b1]] with a0 > a1 > a0+b0 > a1+b0: the first three pops are (0), (1), (0,0);
# the fourth is (0,1) (sibling, slot 5) or (1,0) (child, slot 4). Exact binary fractions tie them (the
# lowest slot, (1,0), wins; the paper's rank tuples would pick (0,1)). The second case has
# (w - b0) + b1 > a1 + b0 in float32 while w + (b1 - b0) == a1 + b0: only the documented order picks (0,1).
SIBLING_VS_CHILD = {
    "tie": ([[-0.5, -0.75], [-0.5, -0.75]], [10, 11, 20, 20, 21, 21], [-1, 0, 0, 1, 2, 1, 2]),
    "rounding": (
        [[-1.9471888542175293, -1.9610860347747803], [-0.27708885073661804, -0.29098591208457947]],
        [10, 11, 20, 21, 20, 21],
        [-1, 0, 0, 1, 1, 2, 2],
    ),
}


@pytest.mark.parametrize("case", sorted(SIBLING_VS_CHILD))
def test_tie_rule_and_score_arithmetic(case):
    logq, tokens, parents = SIBLING_VS_CHILD[case]
    logq = np.asarray(logq, np.float32)
    ids = np.asarray([[10, 11], [20, 21]], np.int32)
    tree = ddtree.build_tree_from_topk(logq, ids, 6)
    assert tree.tokens.tolist() == tokens and tree.parents.tolist() == parents
    args = (jnp.asarray(logq)[None], jnp.asarray(ids)[None], jnp.array([6], jnp.int32))
    for out in (tree_build(*args, max_budget=6, interpret=True), tree_build_reference(*args, max_budget=6)):
        assert out[0][0].tolist() == tokens and out[2][0].tolist() == parents


def test_topk_front_end_full_vocab():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((1, 2, 163840)).astype(np.float32)
    logits[0, 0, [5, 70000, 163839, 12]] = 9.0  # tied maxima: lower ids first
    logq, ids = draft_topk(jnp.asarray(logits), 8)
    np_logq, np_ids = ddtree.topk_logprobs(logits[0], 8)
    np.testing.assert_array_equal(np.asarray(ids[0]), np_ids)
    assert np_ids[0, :4].tolist() == [5, 12, 70000, 163839]
    np.testing.assert_allclose(np.asarray(logq[0]), np_logq, rtol=1e-5)
    tokens, depths, parents, num_nodes = jax.device_get(
        tree_build(logq, ids, jnp.array([8], jnp.int32), max_budget=8, interpret=True)
    )
    tree = ddtree.build_tree(logits[0], 8)
    np.testing.assert_array_equal(tokens[0], tree.tokens)
    np.testing.assert_array_equal(parents[0], tree.parents)


def random_post(seed, tokens, parents, num_nodes, agree):
    """Target choices: with probability `agree` the node's first drafted child, else a random token."""
    rng = np.random.default_rng(seed)
    num_requests, budget = tokens.shape
    post = rng.integers(0, 70, (num_requests, budget + 1))
    for c in range(num_requests):
        agrees = rng.random(budget + 1) < agree
        for i in range(num_nodes[c], 0, -1):
            if agrees[parents[c, i]]:
                post[c, parents[c, i]] = tokens[c, i - 1]
    return jnp.asarray(post, jnp.int32)


def check_accept(tokens, parents, num_nodes, post, max_depth):
    tokens, parents, num_nodes = (jnp.asarray(x) for x in (tokens, parents, num_nodes))
    kernel = jax.device_get(tree_accept(tokens, parents, post, num_nodes, max_depth=max_depth, interpret=True))
    reference = jax.device_get(tree_accept_reference(tokens, parents, post, num_nodes, max_depth=max_depth))
    post = np.asarray(post)
    for c in range(tokens.shape[0]):
        path, bonus = ddtree.follow_tree(np.asarray(tokens[c]), np.asarray(parents[c]), post[c])
        for out in (kernel, reference):
            assert out[0][c].tolist() == path + [-1] * (max_depth + 1 - len(path))
            assert out[1][c] == len(path) and out[2][c] == bonus
    return kernel


@settings(derandomize=True, max_examples=16, deadline=None)
@given(seed=st.integers(0, 2**31), shapes=request_shapes(MAIN), agree=st.sampled_from([0.0, 0.5, 0.9, 1.0]))
def test_accept_matches_walk(seed, shapes, agree):
    budgets, depths, vocabs = shapes
    logq, ids, budgets_arr = make_inputs(seed, MAIN, budgets, depths, vocabs, tied=False)
    tokens, _, parents, num_nodes = jax.device_get(tree_build_reference(logq, ids, budgets_arr, max_budget=MAIN[3]))
    check_accept(tokens, parents, num_nodes, random_post(seed, tokens, parents, num_nodes, agree), MAIN[1])


def test_accept_to_a_leaf_large_and_tiny():
    for bucket, budgets, depths, vocabs in ((LARGE, [512, 40], [8, 8], [512, 3]), (TINY, [1, 0, 1], [1] * 3, [1] * 3)):
        logq, ids, budgets_arr = make_inputs(1, bucket, budgets, depths, vocabs, tied=False)
        tokens, _, parents, num_nodes = jax.device_get(
            tree_build_reference(logq, ids, budgets_arr, max_budget=bucket[3])
        )
        kernel = check_accept(tokens, parents, num_nodes, random_post(1, tokens, parents, num_nodes, 1.0), bucket[1])
        for c, budget in enumerate(budgets):  # agreeing target: walk ends at a leaf
            last = kernel[0][c][kernel[1][c] - 1]
            assert (kernel[1][c] >= 2) == (budget > 0) and last not in parents[c]


def test_visibility_default_depth_covers_chains():
    chain = jnp.asarray([[-1, 0, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 3, -1, -1]], jnp.int32)
    expected = np.stack([ddtree.visibility_from_parents(p) for p in np.asarray(chain)])
    np.testing.assert_array_equal(np.asarray(visibility_from_parents(chain)), expected)
    assert not np.array_equal(np.asarray(visibility_from_parents(chain, max_depth=3)), expected)


def lower_for_cuda(fn, *args):
    with use_abstract_mesh(H200):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "bucket,knobs",
    [
        (TINY, {}),
        ((64, 7, 64, 64), {}),
        ((64, 15, 256, 256), {}),
        (LARGE, {}),
        ((8, 7, 16, 16), dict(max_topk=4, depth_bonus=0.2)),
    ],
)
def test_lowers_for_cuda(bucket, knobs):
    num_requests, num_depths, k, max_budget = bucket
    logq = jnp.zeros((num_requests, num_depths, k), jnp.float32)
    ids = jnp.zeros((num_requests, num_depths, k), jnp.int32)
    budgets = jnp.full((num_requests,), max_budget, jnp.int32)
    hlo = lower_for_cuda(lambda a, b, c: tree_build(a, b, c, max_budget=max_budget, **knobs), logq, ids, budgets)
    assert plgpu.CUSTOM_CALL_TARGET_NAME in hlo
    tokens = jnp.zeros((num_requests, max_budget), jnp.int32)
    rows = jnp.zeros((num_requests, max_budget + 1), jnp.int32)
    hlo = lower_for_cuda(lambda t, p, q, n: tree_accept(t, p, q, n, max_depth=num_depths), tokens, rows, rows, budgets)
    assert plgpu.CUSTOM_CALL_TARGET_NAME in hlo


def test_bad_inputs_name_the_argument():
    logq = jnp.zeros((2, 3, 4), jnp.float32)
    ids = jnp.zeros((2, 3, 4), jnp.int32)
    budgets = jnp.ones(2, jnp.int32)
    with pytest.raises(ValueError, match="logq"):
        tree_build(logq[0], ids, budgets, max_budget=4)
    with pytest.raises(ValueError, match="ids"):
        tree_build(logq, ids.astype(jnp.float32), budgets, max_budget=4)
    with pytest.raises(ValueError, match="budgets"):
        tree_build(logq, ids, budgets[:1], max_budget=4)
    with pytest.raises(ValueError, match="max_budget"):
        tree_build(logq, ids, budgets, max_budget=0)
    with pytest.raises(ValueError, match="draft_logits"):
        draft_topk(logq[0, 0], 2)
    rows = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="post"):
        tree_accept(ids[:, 0], rows, rows[:, :4], budgets, max_depth=3)
    with pytest.raises(ValueError, match="max_depth"):
        tree_accept(ids[:, 0], rows, rows, budgets, max_depth=0)


@pytest.mark.parametrize("budget", [3, 7, 15, 31])
def test_accept_chains_with_non_power_of_two_budgets(budget):
    """Chain DFlash uses B = L (7 or 15): the kernel's power-of-2 node loads must stay inside [C, B+1]."""
    tokens = np.arange(10, 10 + budget, dtype=np.int32)[None]
    parents = np.arange(-1, budget, dtype=np.int32)[None]
    post = np.concatenate([tokens[0], [99]])[None].astype(np.int32)
    post[0, budget // 2] = 98  # the target disagrees halfway down the chain
    check_accept(tokens, parents, np.array([budget], np.int32), jnp.asarray(post), budget)
