"""Which kernels the target GPU can run. The Mosaic GPU kernels (`int4_moe_mosaic`, `mla_prefix_mosaic`) are built on
Hopper's wgmma, which compute capability 9.x has and Ampere, Ada and Blackwell do not; elsewhere the wrappers keep
to their Pallas-Triton kernels."""

import jax


def has_wgmma(device=None):
    """Whether `device` (default: the abstract mesh's device when lowering under one, else the first device) is a
    Hopper GPU. A device without a compute capability (CPU, an abstract device) counts as one, so CPU tests lower
    the Hopper kernels for the abstract H200 they ask for."""
    if device is None:
        device = jax.sharding.get_abstract_mesh().abstract_device or jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    return capability is None or capability.split(".")[0] == "9"
