"""The environment UCX reads once, when ucxx first loads it (:func:`prepare`: set before that,
never over the user's own setting).

- ``UCX_WARN_UNUSED_ENV_VARS=n``: ucxx sets variables this UCX no longer reads
  (``UCX_MEMTYPE_CACHE``), so every process would print two warnings about unused variables (set
  later, the variable is itself reported unused).
- ``UCX_MEM_MMAP_HOOK_MODE=none``, where every transport copies through the host without
  registering memory (TCP, CMA, POSIX or SysV shared memory): by default UCX's memory hooks
  patch ``mmap`` and its kin in place when ``libucs`` loads, 0.4 s of ``sched_yield`` at the
  start of every process on a 2-core machine (``ucm_bistro_apply_patch_atomic``). The hooks only
  keep registration caches right (RDMA, GPU, xpmem/knem), which these transports do not have.
  Hooking through the relocation tables instead (``reloc``) is as quick but corrupts the heap
  of a process that also runs JAX (``munmap_chunk(): invalid pointer`` at exit); ``none``
  installs no hook. With any other transport (``rc``, ``cuda_ipc``, ``sm``, ``UCX_TLS=all``...)
  UCX's default stays. (A survivor reading a killed peer through ``cma`` can abort inside UCX,
  ``cma_ep.c``, with the hooks as without: endpoints run without UCX's error handling.)
"""

from __future__ import annotations

import os
import sys

__all__ = ["prepare", "HOST_TLS", "rndv_thresh"]

#: UCX transports that register no memory (no registration cache for the hooks to keep right).
HOST_TLS = frozenset({"tcp", "cma", "self", "posix", "sysv"})


def prepare(tls: str) -> None:
    """Sets UCX's environment for transports ``tls`` (``UCX_TLS`` syntax) unless UCX is loaded."""
    if "ucxx" in sys.modules:
        return  # UCX has read its environment already
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if {t.strip() for t in tls.split(",") if t.strip()} <= HOST_TLS:
        os.environ.setdefault("UCX_MEM_MMAP_HOOK_MODE", "none")


def rndv_thresh(default: int) -> int:
    """UCX's rendezvous threshold as the environment sets it (bytes; ``k``/``m`` suffixes), or
    ``default`` where unset or ``auto``."""
    v = os.environ.get("UCX_RNDV_THRESH", "").strip().lower().rstrip("b")
    mult = {"k": 1 << 10, "m": 1 << 20}.get(v[-1:], 1)
    digits = v[:-1] if mult > 1 else v
    return int(digits) * mult if digits.isdigit() else default
