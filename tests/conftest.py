"""Test harness: 8 emulated CPU devices, set before jax is imported."""

import importlib
import os
import sys
import tempfile
import warnings

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the CLIs and servers the tests start keep compiled programs here, not in the user's ~/.cache
os.environ.setdefault("K26JAX_CACHE_DIR", tempfile.mkdtemp(prefix="k26jax-test-cache-"))
warnings.filterwarnings("ignore", category=DeprecationWarning, message="The Pallas Triton backend is deprecated")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def _import_script(name: str):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


@pytest.fixture(scope="session")
def import_script():
    """import_script(name): scripts/<name>.py as a module, as `python scripts/<name>.py` sees its imports
    (scripts/ first on sys.path). A fixture: `from conftest import ...` can find tests/gpu/conftest.py instead."""
    return _import_script
