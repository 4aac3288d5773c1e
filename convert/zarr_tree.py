"""An orbax PyTree checkpoint written slice by slice with tensorstore.

orbax's own save takes whole arrays, and K2.6's stacked expert leaves are hundreds of GB, so the converter writes the
same on-disk format orbax writes for a `PyTreeCheckpointer(use_ocdbt=False)` save: one zarr v2 array per leaf in
`params/<a.b.c>/`, plus orbax's `_METADATA` tree description. orbax's restore reads it (tests/test_convert.py).
Chunks are [1, *shard shape] for stacked leaves (one layer of one device's shard: restore on the target mesh reads
whole chunks, and re-writing one layer after a crash touches only that layer's chunk files); for the others (embed,
lm_head, final norm) the shard shape with axis 0 cut into blocks of at most 64 MiB, which the converter writes whole.
Arrays are stored uncompressed: INT4 words and bf16 weights barely compress, and zstd would cost the 2-core host
more than the disk saves. It also makes each chunk file exactly its chunk's C-order bytes, which the converter hashes
and k26jax.checkpoint reads and checks without tensorstore.
"""

from __future__ import annotations

import json
import os

import numpy as np
import tensorstore as ts

from k26jax.checkpoint import ZARR_DTYPES

_TS_CONTEXT = {
    "cache_pool": {"total_bytes_limit": 0},
    "data_copy_concurrency": {"limit": 2},
    "file_io_concurrency": {"limit": 8},
}


class ZarrTree:
    """The leaves of one checkpoint: flat name ("moe.mlp.w13_packed") -> zarr array of (shape, dtype, chunks)."""

    def __init__(self, params_dir: str, leaves: dict[str, dict]):
        self.dir, self.leaves = params_dir, leaves
        os.makedirs(params_dir, exist_ok=True)
        context = ts.Context(_TS_CONTEXT)
        self.arrays = {}
        for name, leaf in leaves.items():
            spec = {
                "driver": "zarr",
                "kvstore": {"driver": "file", "path": os.path.join(params_dir, name)},
                "metadata": {
                    "shape": list(leaf["shape"]),
                    "chunks": list(leaf["chunks"]),
                    "dtype": ZARR_DTYPES[leaf["dtype"]],
                    "compressor": None,
                    "order": "C",
                },
            }
            self.arrays[name] = ts.open(spec, create=True, open=True, context=context).result()

    def write(self, name: str, index: tuple, array: np.ndarray) -> ts.Future:
        """Starts writing `array` into leaf[index]; the returned future resolves once it is in the files."""
        target = self.arrays[name][index] if index else self.arrays[name]
        if tuple(target.shape) != array.shape:
            raise ValueError(f"{name}{list(index)}: writing shape {array.shape} into {tuple(target.shape)}")
        return target.write(array).commit

    def write_orbax_metadata(self) -> None:
        """orbax's `_METADATA`: the tree structure and, per leaf, a jax.Array with its chunk as write shape."""
        tree = {}
        for name, leaf in self.leaves.items():
            keys = name.split(".")
            tree[str(tuple(keys))] = {
                "key_metadata": [{"key": k, "key_type": 2} for k in keys],  # 2: dict key
                "value_metadata": {
                    "value_type": "jax.Array",
                    "skip_deserialize": False,
                    "write_shape": list(leaf["chunks"]),
                },
            }
        meta = {
            "tree_metadata": tree,
            "use_ocdbt": False,
            "use_zarr3": False,
            "store_array_data_equal_to_fill_value": True,
            "custom_metadata": None,
        }
        with open(os.path.join(self.dir, "_METADATA"), "w") as f:
            json.dump(meta, f)
