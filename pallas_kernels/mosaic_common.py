"""Pieces both Mosaic GPU kernels (int4_moe_mosaic, mla_prefix_mosaic) use."""

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


def tiled_smem(shape, dtype, row_bytes):
    """SMEM of (8, swizzle-wide) tiles, swizzled by min(128, row_bytes): the layout TMA and wgmma operands want."""
    swizzle = min(128, row_bytes)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)))
