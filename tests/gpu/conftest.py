"""GPU checks: collected only when the marker expression selects `gpu` (`pytest -m gpu tests/gpu` on the device),
on the platform JAX finds (tests/conftest.py pins JAX_PLATFORMS to cpu for the CPU suite; this undoes it), and
skipped where that is no GPU. The CPU suite never imports these files."""

import jax
import pytest


def _gpu_selected(config) -> bool:
    expr = config.getoption("markexpr") or ""
    return "gpu" in expr and "not gpu" not in expr


def pytest_ignore_collect(collection_path, config):
    return None if _gpu_selected(config) else True


def pytest_configure(config):
    if _gpu_selected(config):
        jax.config.update("jax_platforms", None)


@pytest.fixture(autouse=True, scope="session")
def _needs_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a GPU, the backend is {jax.default_backend()}")
