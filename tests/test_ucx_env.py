"""What wb sets in UCX's environment before ucxx first loads UCX (``wb.runtime.transport.ucx_env``):
no memory hooks only where no transport registers memory, never over
the user's own settings, nothing once UCX is loaded. Fresh interpreters (UCX reads it once)."""

import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import json, os, sys
from wb.runtime.transport import ucx_env
if sys.argv[2] == "loaded":
    import ucxx  # noqa: F401 - UCX read its environment already
ucx_env.prepare(sys.argv[1])
print(json.dumps({k: os.environ.get(k) for k in ("UCX_MEM_MMAP_HOOK_MODE",
                                                  "UCX_WARN_UNUSED_ENV_VARS")}))
"""


def _env_after(tls: str, *, loaded: bool = False, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, tls, "loaded" if loaded else "fresh"],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items()
                              if not k.startswith("UCX_")} | env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tls, hooks", [("tcp,cma,self", "none"), ("tcp,self", "none"),
                                        ("cuda_ipc,cuda_copy,tcp,cma,self", None),
                                        ("rc,tcp,cma,self", None), ("sm,self", None),
                                        ("all", None)])
def test_no_memory_hooks_only_where_no_transport_registers_memory(tls, hooks):
    got = _env_after(tls)
    assert got["UCX_MEM_MMAP_HOOK_MODE"] == hooks
    assert got["UCX_WARN_UNUSED_ENV_VARS"] == "n"


def test_the_user_s_settings_stand_and_a_loaded_ucx_is_left_alone():
    got = _env_after("tcp,self", UCX_MEM_MMAP_HOOK_MODE="bistro", UCX_WARN_UNUSED_ENV_VARS="y")
    assert got == {"UCX_MEM_MMAP_HOOK_MODE": "bistro", "UCX_WARN_UNUSED_ENV_VARS": "y"}
    pytest.importorskip("ucxx")
    assert _env_after("tcp,self", loaded=True)["UCX_MEM_MMAP_HOOK_MODE"] is None


_JAX_AND_UCX = """
import tempfile
import jax.numpy as jnp
from wb.runtime.transport.stores import DirectoryStore
from wb.runtime.transport.ucx import UcxTransport
x = jnp.ones((512, 512)); (x @ x).block_until_ready()
t = UcxTransport(3, DirectoryStore(tempfile.mkdtemp()), tls="tcp,cma,self")
t.connect([])
y = jnp.ones((1024, 1024)); (y @ y).block_until_ready()
t.close(barrier=False)
print("done")
"""


def test_a_process_running_jax_beside_ucx_exits_cleanly():
    """UCX's memory hooks through relocation tables corrupted the heap of a process that runs
    JAX (``munmap_chunk(): invalid pointer`` at its exit): what wb sets must not."""
    pytest.importorskip("jax")
    pytest.importorskip("ucxx")
    out = subprocess.run([sys.executable, "-c", _JAX_AND_UCX], capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in os.environ.items()
                                           if not k.startswith("UCX_")} | {"JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0 and out.stdout.strip().endswith("done"), out.stderr[-2000:]
    assert "invalid pointer" not in out.stderr
