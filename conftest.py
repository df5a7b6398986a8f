"""Repository-wide pytest setup: strict numerics, emulated JAX CPU devices, optional frameworks."""

import importlib.util
import os

import numpy as np
import pytest

# JAX reads this when its backend starts; tests want a 2x2 (and 1x4) mesh of CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

collect_ignore = [name for name, mod in (("wb_torch", "torch"), ("wb_jax", "jax"))
                  if importlib.util.find_spec(mod) is None]


@pytest.fixture(autouse=True)
def _strict_numerics():
    old = np.seterr(all="raise")
    yield
    np.seterr(**old)
