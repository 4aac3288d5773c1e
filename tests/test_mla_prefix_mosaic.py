"""mla_prefix_mosaic: the warp-specialised Mosaic GPU prefix kernel in Mosaic GPU's interpreter (CPU) against
its float32 reference and through tree_mla_attention against the tree reference; argument checks.
(Its cuda lowering, which also checks the shared-memory budget, is in test_tree_mla_attention.py.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla_prefix_mosaic as mp
from pallas_kernels import mla_splits
from pallas_kernels.tree_mla_attention import tree_mla_attention, tree_mla_attention_reference
from tests.test_tree_mla_attention import make_inputs, rel_err

D = mp.LAT_DIM + mp.ROPE_DIM
QK_SCALE = 0.06


def bf16_normal(rng, *shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def random_tail_visibility(rng, C, M, T, see_nothing=()):
    """bool [C, M, T] with random rows; each row sees tail row 0 except the (c, row) pairs in see_nothing."""
    visible = rng.random((C, M, T)) < 0.4
    visible[:, :, 0] = True
    for c, row in see_nothing:
        visible[c, row] = False
    return jnp.asarray(visible)


def split_q(q_CMD):
    """(q_lat [C, M, 512], q_rope [C, M, 64]) of [C, M, 576] rows."""
    return q_CMD[..., : mp.LAT_DIM], q_CMD[..., mp.LAT_DIM :]


INTERLEAVED = ((1, 0, 2), (0, 0, 5), (1, 2, 5), (2, 0, 1), (3, 0, 4), (2, 1, 5), (3, 4, 5))


@pytest.mark.parametrize("splits,T", [(1, 70), (3, 9), ((2, 1, 3, 2), 9), (INTERLEAVED, 9)])
def test_partials_match_reference(splits, T):
    """Ragged prefixes (empty, one key, a partial block, a whole cache that is no multiple of 64), 100 query rows
    (the second row tile runs past them), a tail of 9 rows (one block) or 70 (two, the second mostly past the
    tail's end: TMA reads zeros there); equal splits for every sequence, a count
    each, or an uneven plan whose sequences interleave (the tail in each sequence's last group). Rows of the empty
    prefix that see no tail row must come out 0 with lse -inf, as must every row of a group without keys. Partials
    come at their group's slot, sequence after sequence."""
    rng = np.random.default_rng(T)
    prefix_len = jnp.asarray([0, 1, 127, 264], jnp.int32)
    q, cache, tail = bf16_normal(rng, 4, 100, D), bf16_normal(rng, 4, 264, D), bf16_normal(rng, 4, T, D)
    visible = random_tail_visibility(rng, 4, 100, T, see_nothing=[(0, 3), (0, 99)])
    plan = splits if isinstance(splits, tuple) and isinstance(splits[0], tuple) else mla_splits.equal_plan(splits, 4, 5)
    run = functools.partial(mp.mla_prefix_attention, plan=plan, qk_scale=QK_SCALE, interpret=True)
    o, lse = run(*split_q(q), cache, prefix_len, tail, visible)
    o_ref, lse_ref = mp.mla_prefix_reference(
        *split_q(q), cache, prefix_len, tail, visible, plan=plan, qk_scale=QK_SCALE
    )
    assert o.shape == (len(plan), 100, mp.LAT_DIM) and lse.shape == (len(plan), 100)
    np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_ref))  # the same groups are empty
    slots = mla_splits.partial_slots(plan, 4)
    seq0 = [slots[g] for g, group in enumerate(plan) if group[0] == 0]
    assert np.isneginf(np.asarray(lse)[seq0[:-1]]).all()  # no prefix: only the tail group sees keys
    assert np.isneginf(lse[seq0[-1], [3, 99]]).all() and not np.asarray(o[seq0[-1], [3, 99]]).any()
    assert not np.asarray(o)[np.isneginf(np.asarray(lse))].any()
    finite = np.isfinite(lse_ref)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_ref)[finite], atol=2e-3)
    assert rel_err(o, o_ref) < 1e-2  # P is rounded to bf16 for the value MMA
    if plan == INTERLEAVED:  # the first groups of sequences 1 (one key) and 2 (two blocks) get no block
        np.testing.assert_array_equal(slots, [1, 0, 2, 3, 5, 4, 6])
        assert np.isneginf(lse[slots[0]]).all() and np.isneginf(lse[slots[3]]).all()
        assert np.isfinite(lse[slots[2]]).all() and np.isfinite(lse[slots[5]]).all()


def test_group_table_scales_the_plan_to_the_prefix():
    """Planned bounds b land at floor(b * n / K) for a prefix of n key blocks: a full cache keeps the plan, a
    shorter prefix is cut in its proportions, an empty one gives empty groups; only a sequence's last group
    has the tail's blocks, and a prefix past S_max counts as S_max for the blocks; partials go sequence after
    sequence."""
    plan, cache_seq = ((0, 0, 3), (1, 0, 8), (0, 3, 8)), jnp.asarray([6, 7], jnp.int32)
    table = mp.group_table(plan, jnp.asarray([512, 0], jnp.int32), cache_seq, 8, 2)
    np.testing.assert_array_equal(table, [[0, 6, 0, 3, 0, 512, 0], [1, 7, 0, 0, 2, 0, 2], [0, 6, 3, 5, 2, 320, 1]])
    table = mp.group_table(plan, jnp.asarray([257, 9999], jnp.int32), cache_seq, 8, 1)  # 5 blocks; 157, clamped to 8
    np.testing.assert_array_equal(table, [[0, 6, 0, 1, 0, 257, 0], [1, 7, 0, 8, 1, 9999, 2], [0, 6, 1, 4, 1, 193, 1]])


def test_large_logits_stay_finite():
    rng = np.random.default_rng(7)
    prefix_len = jnp.asarray([200], jnp.int32)
    q, cache = bf16_normal(rng, 1, 64, D, scale=30.0), bf16_normal(rng, 1, 200, D, scale=30.0)
    tail, visible = bf16_normal(rng, 1, 5, D, scale=30.0), random_tail_visibility(rng, 1, 64, 5)
    plan = mla_splits.equal_plan(1, 1, 4)
    o, lse = mp.mla_prefix_attention(
        *split_q(q), cache, prefix_len, tail, visible, plan=plan, qk_scale=1.0, interpret=True
    )
    o_ref, _ = mp.mla_prefix_reference(*split_q(q), cache, prefix_len, tail, visible, plan=plan, qk_scale=1.0)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(lse)).all()
    assert rel_err(o, o_ref) < 1e-2


@pytest.mark.parametrize("T,H,prefix_lens", [(9, 8, [0, 5, 304]), (1, 64, [1, 300])])
def test_tree_attention_with_mosaic_prefix(T, H, prefix_lens):
    """Whole tree attention (Mosaic prefix and tail, merge): 72 rows (the second tile past their end) and a 9-row
    tail (padded to 16 rows), and decode at 64 heads (one tail row); random trees, rows that see no prefix."""
    args = make_inputs(3, T, H, R=mp.LAT_DIM, P=mp.ROPE_DIM, prefix_lens=prefix_lens, S=304, dtype=jnp.bfloat16)
    out = tree_mla_attention(*args, scale=0.05, prefix_kernel="mosaic", interpret=True)
    f32 = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
    assert rel_err(out, tree_mla_attention_reference(*f32, scale=0.05)) < 1e-2


def test_layer_of_a_cache_stack():
    """The Mosaic prefix reads layer `layer` inside a [L, C, S_max, 576] stack (rows layer * C + c)."""
    q_lat, q_rope, _, prefix_len, tail, vis = make_inputs(
        4, 2, 32, R=mp.LAT_DIM, P=mp.ROPE_DIM, prefix_lens=[70, 3], S=136, dtype=jnp.bfloat16
    )
    stack = bf16_normal(np.random.default_rng(5), 3, 2, 136, D)
    out = tree_mla_attention(
        q_lat,
        q_rope,
        stack,
        prefix_len,
        tail,
        vis,
        scale=0.05,
        prefix_kernel="mosaic",
        layer=jnp.int32(2),
        interpret=True,
    )
    f32 = lambda a: a.astype(jnp.float32)
    want = tree_mla_attention_reference(f32(q_lat), f32(q_rope), f32(stack[2]), prefix_len, f32(tail), vis, scale=0.05)
    assert rel_err(out, want) < 1e-2


def test_bad_arguments_raise():
    rng = np.random.default_rng(0)
    (q_lat, q_rope), lens = split_q(bf16_normal(rng, 1, 64, D)), jnp.asarray([5], jnp.int32)
    tail, visible = bf16_normal(rng, 1, 3, D), random_tail_visibility(rng, 1, 64, 3)
    run = functools.partial(mp.mla_prefix_attention, plan=((0, 0, 1),), qk_scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="cache rows"):
        run(q_lat, q_rope, bf16_normal(rng, 1, 777, D), lens, tail, visible)
    with pytest.raises(ValueError, match="q_rope"):
        run(q_lat, q_rope[:, :40], bf16_normal(rng, 1, 64, D), lens, tail, visible)
    with pytest.raises(ValueError, match="bf16"):
        run(q_lat, q_rope.astype(jnp.float32), bf16_normal(rng, 1, 64, D), lens, tail, visible)
    with pytest.raises(ValueError, match="tail_visible"):
        run(q_lat, q_rope, bf16_normal(rng, 1, 64, D), lens, tail, visible[:, :, :2])
    with pytest.raises(ValueError, match="tail must be"):
        run(q_lat, q_rope, bf16_normal(rng, 1, 64, D), lens, tail[..., :512], visible)
    for bad_splits in ((1, 2), 0):  # two counts for one sequence; no split
        with pytest.raises(ValueError, match="num_splits"):
            mla_splits.equal_plan(bad_splits, 1, 1)
    for bad_plan in (((0, 0, 2), (0, 1, 2)), ((0, 0, 1), (1, 0, 2)), ((0, 1, 2),), ((0, 0, 1),)):
        with pytest.raises(ValueError, match="plan"):  # overlap; no sequence 1; a gap at 0; short of the cache's 2
            mp.mla_prefix_attention(
                q_lat,
                q_rope,
                bf16_normal(rng, 1, 128, D),
                lens,
                tail,
                visible,
                plan=bad_plan,
                qk_scale=1.0,
                interpret=True,
            )
    huge_cache = jax.ShapeDtypeStruct((1, 64 * 46340 + 8, D), jnp.bfloat16)  # traced only, never allocated
    with pytest.raises(ValueError, match="at most 2965760"):
        jax.eval_shape(
            functools.partial(mp.mla_prefix_attention, plan=((0, 0, 46341),), qk_scale=1.0, interpret=True),
            q_lat,
            q_rope,
            huge_cache,
            lens,
            tail,
            visible,
        )
    args = make_inputs(1, 2, 16, R=mp.LAT_DIM, P=mp.ROPE_DIM, prefix_lens=[3], S=777, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="S_max % 8"):
        tree_mla_attention(*args, scale=0.05, prefix_kernel="mosaic", interpret=True)
    with pytest.raises(ValueError, match="prefix_kernel"):
        tree_mla_attention(*args, scale=0.05, prefix_kernel="cuda", interpret=True)
