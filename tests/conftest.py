"""Test harness: 8 emulated CPU devices, set before jax is imported."""

import atexit
import importlib
import os
import shutil
import sys
import tempfile
import warnings

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the tests, and the CLIs and servers they start, keep compiled programs in one cache of this run (not the user's
# ~/.cache): a program that several tests compile is compiled once. The process that made it removes it.
if "K26JAX_CACHE_DIR" not in os.environ:
    os.environ["K26JAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="k26jax-test-cache-")
    atexit.register(shutil.rmtree, os.environ["K26JAX_CACHE_DIR"], ignore_errors=True)
warnings.filterwarnings("ignore", category=DeprecationWarning, message="The Pallas Triton backend is deprecated")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", os.environ["K26JAX_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


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
