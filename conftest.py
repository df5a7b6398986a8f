"""Repository-wide pytest setup: strict numerics, emulated JAX CPU devices, optional frameworks."""

import importlib.util
import os
import shutil
import tempfile

import numpy as np
import pytest

# JAX reads this when its backend starts; tests want a 2x2 (and 1x4) mesh of CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# JAX's persistent compilation cache, in a folder of this run's own (removed when it ends): a
# program is compiled once and read back by every later test or process that builds it again
# (the same load function probed in the test process, in each demo process, in the examples;
# a fresh closure of the same function is a new program to JAX's in-memory cache, not to this
# one). Every program is kept: the probes' programs compile in well under JAX's 1 s threshold.
_JAX_CACHE = tempfile.mkdtemp(prefix="wb-jax-cache-")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _JAX_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

collect_ignore = [name for name, mod in (("wb_torch", "torch"), ("wb_jax", "jax"))
                  if importlib.util.find_spec(mod) is None]


def pytest_unconfigure(config):
    shutil.rmtree(_JAX_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _strict_numerics():
    old = np.seterr(all="raise")
    yield
    np.seterr(**old)
