"""Latent KV cache: rows [layers, C, S_max, R+Dr] (kv_a-normed c_kv, then roped k_pe) and lengths [C].

The model never writes the cache; it returns the latent rows of the tokens it ran. Prefill stores them at
positions 0..T-1; a decode or tree-verify step stores the accepted tail rows at [len, len+n) (commit_tail).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from k26jax.config import ModelConfig


@struct.dataclass
class KVCache:
    rows: jax.Array  # [layers, C, S_max, R+Dr]
    lengths: jax.Array  # [C] int32, valid rows per sequence

    @property
    def max_len(self) -> int:
        return self.rows.shape[2]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    rows = jnp.zeros((cfg.num_hidden_layers, batch, max_len, cfg.latent_dim), dtype)
    return KVCache(rows, jnp.zeros((batch,), jnp.int32))


def write_prefill(cache: KVCache, rows_LCTW, lengths_C) -> KVCache:
    """Store prompt rows at positions 0..T-1 (rows past a prompt's length are ignored by `lengths`)."""
    rows = jax.lax.dynamic_update_slice(cache.rows, rows_LCTW.astype(cache.rows.dtype), (0, 0, 0, 0))
    return KVCache(rows, lengths_C.astype(jnp.int32))


def gather_path(x_CT, path_CP):
    """x[c, path[c, j]] for every path slot: [C, T, ...] -> [C, P, ...]; padded slots (-1) give row 0."""
    idx = jnp.maximum(path_CP, 0).reshape(path_CP.shape + (1,) * (x_CT.ndim - 2))
    return jnp.take_along_axis(x_CT, idx, axis=1)


def commit_tail(cache: KVCache, tail_rows_LCTW, path_CP, accept_len_C, active_C=None) -> KVCache:
    """Write the accepted tail rows tail[path[c, j]] to positions len[c] + j for j < accept_len[c].

    In place when the cache is donated. Sequences with active False keep their cache and length.
    """
    n_layers, C, _, W = tail_rows_LCTW.shape
    P = path_CP.shape[1]
    n = accept_len_C if active_C is None else jnp.where(active_C, accept_len_C, 0)
    accepted = jax.vmap(gather_path, in_axes=(0, None))(tail_rows_LCTW, path_CP)  # [layers, C, P, W]
    j = jnp.arange(P, dtype=jnp.int32)[None]
    pos = jnp.where(j < n[:, None], cache.lengths[:, None] + j, cache.max_len)  # out of range -> dropped
    c = jnp.broadcast_to(jnp.arange(C)[:, None], (C, P))
    rows = cache.rows.at[:, c, pos].set(accepted.astype(cache.rows.dtype), mode="drop")
    return KVCache(rows, cache.lengths + n)
