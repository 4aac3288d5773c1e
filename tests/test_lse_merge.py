"""lse_merge: the Pallas merge kernel (interpret mode) against its jnp reference and against attention computed
whole; partials that saw nothing, sequences with different partial counts, rows no partial saw, edge sizes;
argument checks and the cuda lowering."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import triton as plgpu
from jax.sharding import use_abstract_mesh

from pallas_kernels import lse_merge
from tests.test_tree_mla_attention import H200


def random_partials(rng, G, M, R, empty=()):
  """o [G, M, R] and lse [G, M] float32; the (g, row) pairs in empty saw nothing (o 0, lse -inf)."""
  o = rng.standard_normal((G, M, R)).astype(np.float32)
  lse = (rng.standard_normal((G, M)) * 4).astype(np.float32)
  for g, row in empty:
    o[g, row], lse[g, row] = 0.0, -np.inf
  return jnp.asarray(o), jnp.asarray(lse)


@pytest.mark.parametrize("M,R", [(1, 16), (37, 64), (130, 512)])
def test_merge_matches_reference(M, R):
  """Sequences of 3, 1 and 2 partials in interleaved order (one padded twice with -1); a row of sequence 0 that
  one partial did not see, a row that none of sequence 2's partials saw (0 out); bf16 output too."""
  rng = np.random.default_rng(M)
  groups = lse_merge.group_index([[4, 0, 2], [5], [1, 3]])
  np.testing.assert_array_equal(groups, [[4, 0, 2], [5, -1, -1], [1, 3, -1]])
  o, lse = random_partials(rng, 6, M, R, empty=[(0, M - 1), (1, 0), (3, 0)])
  want = lse_merge.merge_reference(o, lse, groups)
  got = lse_merge.merge_partials(o, lse, jnp.asarray(groups), interpret=True)
  assert got.shape == (3, M, R) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert not np.asarray(got[2, 0]).any()
  np.testing.assert_allclose(got[1], o[5], rtol=1e-6)  # one partial: itself
  bf16 = lse_merge.merge_partials(o, lse, jnp.asarray(groups), out_dtype=jnp.bfloat16, interpret=True)
  assert bf16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(bf16, np.float32), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("num_groups", [2, 130])
def test_padding_rows_are_not_read(num_groups):
  """Partials padded to 64 rows, NaN in the padding: the merge of the first 37 rows never reads it. 130 partials
  for one sequence (decode's many splits of one long prefix) load as one [256, 1, 32] tile."""
  rng = np.random.default_rng(num_groups)
  o, lse = random_partials(rng, num_groups, 64, 64)
  o, lse = o.at[:, 37:].set(jnp.nan), lse.at[:, 37:].set(jnp.nan)
  groups = np.arange(num_groups, dtype=np.int32)[::-1].reshape(1, -1)
  got = lse_merge.merge_partials(o, lse, jnp.asarray(groups), num_rows=37, interpret=True)
  assert got.shape == (1, 37, 64)
  np.testing.assert_allclose(got, lse_merge.merge_reference(o[:, :37], lse[:, :37], groups), rtol=1e-5, atol=1e-6)


def test_merge_equals_attention_over_all_keys():
  """Softmax-weighted sums over disjoint key ranges, merged, equal the softmax over all keys (independent of
  merge_reference): 4 ranges of 1, 9, 0 and 30 keys, the empty one lse -inf."""
  rng = np.random.default_rng(1)
  M, R, bounds = 5, 16, [0, 1, 10, 10, 40]
  s = rng.standard_normal((M, 40)) * 3
  v = rng.standard_normal((40, R))
  o, lse = [], []
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    if hi == lo:
      o.append(np.zeros((M, R))), lse.append(np.full(M, -np.inf))
      continue
    p = np.exp2(s[:, lo:hi])
    o.append(p @ v[lo:hi] / p.sum(1, keepdims=True)), lse.append(np.log2(p.sum(1)))
  p = np.exp2(s)
  want = p @ v / p.sum(1, keepdims=True)
  got = lse_merge.merge_partials(jnp.asarray(np.stack(o), jnp.float32), jnp.asarray(np.stack(lse), jnp.float32),
                                 jnp.asarray([[2, 0, 3, 1]], jnp.int32), interpret=True)
  np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)


def test_large_lse_stays_finite():
  o, lse = random_partials(np.random.default_rng(2), 3, 8, 16)
  lse = lse * 1e3 + 5e3
  got = lse_merge.merge_partials(o, lse, jnp.asarray([[0, 1, 2]], jnp.int32), interpret=True)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, lse_merge.merge_reference(o, lse, np.asarray([[0, 1, 2]])), rtol=1e-5, atol=1e-6)


def test_bad_arguments_raise():
  o, lse = random_partials(np.random.default_rng(3), 2, 4, 16)
  groups = jnp.asarray([[0, 1]], jnp.int32)
  with pytest.raises(ValueError, match="float32"):
    lse_merge.merge_partials(o.astype(jnp.bfloat16), lse, groups, interpret=True)
  with pytest.raises(ValueError, match="lse"):
    lse_merge.merge_partials(o, lse[:, :3], groups, interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    lse_merge.merge_partials(o[..., :12], lse, groups, interpret=True)


def test_lowers_for_cuda():
  """The kernel lowers for an H200 (Triton), at decode's 136 partials of 64 rows."""
  shapes = [jax.ShapeDtypeStruct((136, 64, 512), jnp.float32), jax.ShapeDtypeStruct((136, 64), jnp.float32),
            jax.ShapeDtypeStruct((8, 17), jnp.int32)]
  with use_abstract_mesh(H200):
    hlo = jax.jit(lambda o, lse, g: lse_merge.merge_partials(o, lse, g, out_dtype=jnp.bfloat16)).trace(
        *shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert hlo.count(plgpu.CUSTOM_CALL_TARGET_NAME) == 1
