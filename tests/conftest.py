"""Test harness: 8 emulated CPU devices, set before jax is imported."""

import os
import tempfile
import warnings

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# the CLIs and servers the tests start keep compiled programs here, not in the user's ~/.cache
os.environ.setdefault("K26JAX_CACHE_DIR", tempfile.mkdtemp(prefix="k26jax-test-cache-"))
warnings.filterwarnings("ignore", category=DeprecationWarning, message="The Pallas Triton backend is deprecated")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
