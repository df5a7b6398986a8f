"""The environment UCX reads once, when ucxx first loads it (:func:`prepare`: set before that,
never over the user's own setting).

- ``UCX_WARN_UNUSED_ENV_VARS=n``: ucxx sets variables this UCX no longer reads
  (``UCX_MEMTYPE_CACHE``), so every process would print two warnings about unused variables (set
  later, the variable is itself reported unused).
- ``UCX_MEM_MMAP_HOOK_MODE=reloc``, where every transport is a host one (TCP, shared memory,
  CMA): by default UCX's memory hooks patch ``mmap`` and its kin in place, which takes 0.4 s of
  ``sched_yield`` at the start of every process on a 2-core machine (``libucs``'s constructor,
  ``ucm_bistro_apply_patch_atomic``), against 2 ms through the relocation tables. The hooks keep
  registration caches of RDMA and GPU memory right, which these transports do not have; with
  any other transport (``rc``, ``cuda_ipc``, ``UCX_TLS=all``...) UCX's default stays.
"""

from __future__ import annotations

import os
import sys

__all__ = ["prepare", "HOST_TLS"]

#: UCX transports that register no memory with a device (no registration cache to keep right).
HOST_TLS = frozenset({"tcp", "cma", "self", "sm", "shm", "posix", "sysv", "xpmem", "knem"})


def prepare(tls: str) -> None:
    """Sets UCX's environment for transports ``tls`` (``UCX_TLS`` syntax) unless UCX is loaded."""
    if "ucxx" in sys.modules:
        return  # UCX has read its environment already
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if {t.strip() for t in tls.split(",") if t.strip()} <= HOST_TLS:
        os.environ.setdefault("UCX_MEM_MMAP_HOOK_MODE", "reloc")
