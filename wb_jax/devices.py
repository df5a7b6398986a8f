"""JAX's devices on one machine: emulated CPU devices, for meshes without GPUs."""

from __future__ import annotations

import jax

import wb

__all__ = ["use_cpu_devices"]


def use_cpu_devices(n: int) -> int:
    """Asks JAX for ``n`` emulated CPU devices (for meshes on one machine); returns how many exist.

    Works before JAX starts its backend (the first computation). Afterwards the devices that
    exist are kept: enough of them is fine, too few is an error.

    Args:
        n: the number of CPU devices wanted.

    Returns:
        The number of devices JAX has.

    Raises:
        wb.SpecError: JAX has already started with fewer than ``n`` devices.
    """
    try:
        jax.config.update("jax_num_cpu_devices", max(int(n), 1))
    except RuntimeError as e:  # the backend has started (a notebook, a test session)
        have = len(jax.devices())
        if have < n:
            raise wb.SpecError(
                f"JAX has already started with {have} devices, fewer than the {n} asked for; "
                f"call use_cpu_devices({n}) before the first JAX computation, or set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={n}") from e
    return len(jax.devices())
