"""CPU reference k26jax.ddtree against an independent transcription of the paper's heap and brute force."""

import heapq
import itertools

import jax
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from k26jax import ddtree

SETTINGS = settings(derandomize=True, max_examples=60, deadline=None)


def paper_build(logq, ids, budget):
    """ddtree.md §2 (liranringel/ddtree build_ddtree_tree): heap keyed by (-score, rank tuple).

    Returns (tokens, depths, parents, every score pushed)."""
    num_depths, k = logq.shape[0], min(budget, logq.shape[1])
    heap = [(-float(logq[0, 0]), (0,), 0, 1, 0, logq[0, 0])] if k else []
    tokens, depths, parents, pushed = [], [], [-1], [logq[0, 0]]
    while heap and len(tokens) < budget:
        _, ranks, parent, d, r, logw = heapq.heappop(heap)
        idx = len(tokens) + 1
        tokens.append(ids[d - 1, r]), depths.append(d), parents.append(parent)
        if r + 1 < k:
            lw = logw - logq[d - 1, r] + logq[d - 1, r + 1]
            heapq.heappush(heap, (-float(lw), ranks[:-1] + (r + 1,), parent, d, r + 1, lw))
            pushed.append(lw)
        if d < num_depths:
            lw = logw + logq[d, 0]
            heapq.heappush(heap, (-float(lw), ranks + (0,), idx, d + 1, 0, lw))
            pushed.append(lw)
    return np.array(tokens), np.array(depths), np.array(parents), np.array(pushed)


def node_scores(tree, logq, ids):
    """float64 score of every built node: sum over its path of logq at the node's rank."""
    scores = np.zeros(tree.num_nodes + 1)
    for i in range(1, tree.num_nodes + 1):
        d = tree.depths[i - 1]
        rank = int(np.flatnonzero(ids[d - 1] == tree.tokens[i - 1])[0])
        scores[i] = scores[tree.parents[i]] + float(logq[d - 1, rank])
    return scores[1:]


def check_structure(tree, budget, num_depths):
    n = tree.num_nodes
    assert tree.tokens.shape == tree.depths.shape == (budget,)
    assert tree.parents.shape == (budget + 1,) and tree.parents[0] == -1
    assert (tree.tokens[n:] == -1).all() and (tree.depths[n:] == -1).all() and (tree.parents[n + 1 :] == -1).all()
    depth_of = np.concatenate([[0], tree.depths])
    for i in range(1, n + 1):
        assert 0 <= tree.parents[i] < i
        assert depth_of[i] == depth_of[tree.parents[i]] + 1 <= num_depths
    siblings = {}
    for i in range(1, n + 1):
        key = (tree.parents[i], tree.tokens[i - 1])
        assert key not in siblings, "two children of one node share a token"
        siblings[key] = i
    # visibility == ancestor relation, walked independently
    expected = np.zeros_like(tree.visibility)
    for i in range(budget + 1):
        j = i
        while j >= 0:
            expected[i, j] = True
            j = tree.parents[j] if i <= n else -1
    np.testing.assert_array_equal(tree.visibility, expected)


def random_logits(seed, num_depths, vocab, tied):
    rng = np.random.default_rng(seed)
    if tied:
        return rng.integers(0, 3, (num_depths, vocab)).astype(np.float32)
    return (rng.standard_normal((num_depths, vocab)) * rng.uniform(0.5, 4)).astype(np.float32)


@SETTINGS
@given(seed=st.integers(0, 2**31), num_depths=st.integers(1, 9), vocab=st.integers(1, 40), budget=st.integers(0, 70))
def test_matches_paper_heap_without_ties(seed, num_depths, vocab, budget):
    logits = random_logits(seed, num_depths, vocab, tied=False)
    tree = ddtree.build_tree(logits, budget)
    logq, ids = ddtree.topk_logprobs(logits, max(budget, 1))
    tokens, depths, parents, pushed = paper_build(logq, ids, budget)
    assume(len(np.unique(pushed)) == len(pushed))
    n = tree.num_nodes
    assert n == len(tokens) == min(budget, sum(min(budget, vocab) ** d for d in range(1, num_depths + 1)))
    np.testing.assert_array_equal(tree.tokens[:n], tokens)
    np.testing.assert_array_equal(tree.depths[:n], depths)
    np.testing.assert_array_equal(tree.parents[: n + 1], parents)
    check_structure(tree, budget, num_depths)


@SETTINGS
@given(seed=st.integers(0, 2**31), num_depths=st.integers(1, 6), vocab=st.integers(1, 12), budget=st.integers(1, 50))
def test_tied_logits_give_a_valid_optimal_tree(seed, num_depths, vocab, budget):
    logits = random_logits(seed, num_depths, vocab, tied=True)
    tree = ddtree.build_tree(logits, budget)
    check_structure(tree, budget, num_depths)
    logq, ids = ddtree.topk_logprobs(logits, budget)
    paper_tokens = paper_build(logq, ids, budget)[0]
    assert tree.num_nodes == len(paper_tokens)
    ours = np.exp(node_scores(tree, logq, ids))
    assert np.all(np.diff(ours) <= 1e-6)  # best-first: pop order never improves
    # any optimal tree has the same expected acceptance (sum of path probabilities)
    paper_tree = ddtree.Tree(*paper_build(logq, ids, budget)[:3], None, len(paper_tokens))
    np.testing.assert_allclose(ours.sum(), np.exp(node_scores(paper_tree, logq, ids)).sum(), rtol=1e-5)


@settings(derandomize=True, max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), num_depths=st.integers(1, 3), vocab=st.integers(1, 4), budget=st.integers(1, 90))
def test_optimal_against_brute_force(seed, num_depths, vocab, budget):
    logits = random_logits(seed, num_depths, vocab, tied=False)
    logq, ids = ddtree.topk_logprobs(logits, vocab)
    k = min(budget, vocab)
    every_score = [
        sum(float(logq[d, r]) for d, r in enumerate(ranks))
        for depth in range(1, num_depths + 1)
        for ranks in itertools.product(range(k), repeat=depth)
    ]
    best = np.sort(np.exp(every_score))[::-1][:budget].sum()
    tree = ddtree.build_tree(logits, budget)
    assert tree.num_nodes == min(budget, len(every_score))
    np.testing.assert_allclose(np.exp(node_scores(tree, logq, ids)).sum(), best, rtol=1e-5)


def test_topk_order_and_logprobs_match_lax():
    rng = np.random.default_rng(0)
    logits = rng.integers(-2, 2, (5, 300)).astype(np.float32)  # many exact ties
    logits[1] = rng.standard_normal(300)
    for k in (1, 7, 300):
        logq, ids = ddtree.topk_logprobs(logits, k)
        top, top_ids = jax.lax.top_k(logits, k)
        np.testing.assert_array_equal(ids, np.asarray(top_ids))
        expected = np.asarray(top) - np.asarray(jax.nn.logsumexp(logits, axis=-1, keepdims=True))
        np.testing.assert_allclose(logq, expected, rtol=1e-6, atol=1e-6)
    assert ddtree.topk_logprobs(logits, 1000)[0].shape == (5, 300)


def test_budget_beyond_possible_nodes_pads():
    logits = random_logits(3, 2, 3, tied=False)
    tree = ddtree.build_tree(logits, 20)
    assert tree.num_nodes == 3 + 9
    check_structure(tree, 20, 2)
    empty = ddtree.build_tree(logits, 0)
    assert empty.num_nodes == 0 and empty.parents.tolist() == [-1] and empty.visibility.tolist() == [[True]]


def test_zero_probability_tokens_are_not_drafted():
    logits = np.full((2, 6), -np.inf, np.float32)
    logits[:, :2] = [[1.0, 0.5], [0.0, -1.0]]
    tree = ddtree.build_tree(logits, 10)
    assert tree.num_nodes == 2 + 4 and set(tree.tokens[:6].tolist()) == {0, 1}


def test_knobs_change_the_tree_as_documented():
    logits = random_logits(11, 6, 50, tied=False)
    plain = ddtree.build_tree(logits, 40)
    np.testing.assert_array_equal(ddtree.build_tree(logits, 40, max_topk=None, depth_bonus=0.0).parents, plain.parents)
    capped = ddtree.build_tree(logits, 40, max_topk=2)
    logq, ids = ddtree.topk_logprobs(logits, 40)
    for token, d in zip(capped.tokens, capped.depths):
        assert token in ids[d - 1, :2]
    deep = ddtree.build_tree(logits, 40, depth_bonus=2.0)
    assert deep.depths.mean() > plain.depths.mean()
    check_structure(capped, 40, 6)
    check_structure(deep, 40, 6)


def accepted_nodes(tokens, parents, post):
    """Independent acceptance: a node is accepted iff its parent is and it drafted the parent's choice."""
    accepted = {0}
    for i in range(1, len(parents)):
        if parents[i] in accepted and tokens[i - 1] == post[parents[i]]:
            accepted.add(i)
    return sorted(accepted)


@SETTINGS
@given(seed=st.integers(0, 2**31), budget=st.integers(1, 40), greedy=st.booleans())
def test_follow_tree(seed, budget, greedy):
    rng = np.random.default_rng(seed)
    logits = random_logits(seed, 5, 6, tied=False)
    tree = ddtree.build_tree(logits, budget)
    post = rng.integers(0, 6, budget + 1)
    if greedy:  # target agrees with the first child wherever there is one
        for i in range(tree.num_nodes, 0, -1):
            post[tree.parents[i]] = tree.tokens[i - 1]
    path, bonus = ddtree.follow_tree(tree.tokens, tree.parents, post)
    assert path == accepted_nodes(tree.tokens, tree.parents, post)
    assert bonus == post[path[-1]]
    if greedy:
        assert len(path) - 1 == tree.depths[path[-1] - 1] if len(path) > 1 else True


def test_follow_tree_by_hand():
    #        0 -a-> 1 -c-> 3
    #          -b-> 2 -a-> 4
    tokens, parents = [10, 11, 12, 10], [-1, 0, 0, 1, 2]
    assert ddtree.follow_tree(tokens, parents, [11, 0, 10, 0, 7]) == ([0, 2, 4], 7)
    assert ddtree.follow_tree(tokens, parents, [99, 0, 0, 0, 0]) == ([0], 99)
    assert ddtree.follow_tree(tokens, parents, [10, 12, 0, 5, 0]) == ([0, 1, 3], 5)


def test_bad_inputs_name_the_argument():
    logq = np.zeros((2, 3), np.float32)
    ids = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match="draft_logits"):
        ddtree.build_tree(np.zeros(5), 4)
    with pytest.raises(ValueError, match="draft_logits"):
        ddtree.build_tree(np.full((2, 3), np.nan), 4)
    with pytest.raises(ValueError, match="logq"):
        ddtree.build_tree_from_topk(logq.astype(np.float64), ids, 4)
    with pytest.raises(ValueError, match="ids"):
        ddtree.build_tree_from_topk(logq, ids[:, :2], 4)
    with pytest.raises(ValueError, match="budget"):
        ddtree.build_tree_from_topk(logq, ids, -1)
    with pytest.raises(ValueError, match="max_topk"):
        ddtree.build_tree_from_topk(logq, ids, 4, max_topk=0)
