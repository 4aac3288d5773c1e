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


# The slowest files first, so that `scripts/test.sh`'s two workers (whole files each) end together instead of one
# finishing a long file alone (about 2 minutes of the suite's wall time on 2 cores).
SLOWEST_FIRST = (
    "test_bench_share.py",
    "test_bench_e2e.py",
    "test_bench_auto.py",
    "test_server.py",
    "test_distributed.py",
    "test_engine.py",
    "test_autobudget.py",
    "test_mini_pair.py",
    "test_cli.py",
    "test_serve_scheduler.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the other files keep their order
