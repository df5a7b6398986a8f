"""The environment UCX reads once, when ucxx first loads it (:func:`prepare`: set before that,
never over the user's own setting).

- ``UCX_WARN_UNUSED_ENV_VARS=n``: ucxx sets variables this UCX no longer reads
  (``UCX_MEMTYPE_CACHE``), so every process would print two warnings about unused variables (set
  later, the variable is itself reported unused).

UCX's memory hooks are left as UCX sets them, although installing them is most of UCX's start on
a 2-core machine (0.4 s of ``sched_yield`` in ``libucs``'s constructor, which patches ``mmap`` in
place: ``ucm_bistro_apply_patch_atomic``). Both ways around it were tried and dropped:
``UCX_MEM_MMAP_HOOK_MODE=reloc`` corrupts the heap of a process that also runs JAX
(``munmap_chunk(): invalid pointer`` at its exit), and with ``none`` a surviving rollout of
``bench/chaos.py`` aborted inside UCX (``cma_ep.c``: ``process_vm_readv`` of a killed peer,
"No such process"), which no run with the hooks did.
"""

from __future__ import annotations

import os
import sys

__all__ = ["prepare", "rndv_thresh"]


def prepare() -> None:
    """Sets UCX's environment (see the module doc) unless UCX is loaded."""
    if "ucxx" in sys.modules:
        return  # UCX has read its environment already
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def rndv_thresh(default: int) -> int:
    """UCX's rendezvous threshold as the environment sets it (bytes; ``k``/``m`` suffixes), or
    ``default`` where unset or ``auto``."""
    v = os.environ.get("UCX_RNDV_THRESH", "").strip().lower().rstrip("b")
    mult = {"k": 1 << 10, "m": 1 << 20}.get(v[-1:], 1)
    digits = v[:-1] if mult > 1 else v
    return int(digits) * mult if digits.isdigit() else default
