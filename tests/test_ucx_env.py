"""What wb sets in UCX's environment before ucxx first loads UCX (``wb.runtime.transport.ucx_env``):
the unused-variables warning off, never over the user's own settings, nothing once UCX is
loaded, and UCX's memory hooks left alone (a process running JAX beside UCX exits cleanly).
Fresh interpreters (UCX reads its environment once)."""

import json
import os
import subprocess
import sys

import pytest

_PROBE = """
import json, os, sys
from wb.runtime.transport import ucx_env
if sys.argv[1] == "loaded":
    import ucxx  # noqa: F401 - UCX read its environment already
ucx_env.prepare()
print(json.dumps({k: os.environ.get(k) for k in ("UCX_MEM_MMAP_HOOK_MODE",
                                                  "UCX_WARN_UNUSED_ENV_VARS")}))
"""


def _clean_env(**env) -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("UCX_")} | env


def _env_after(*, loaded: bool = False, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, "loaded" if loaded else "fresh"],
                         capture_output=True, text=True, timeout=120, env=_clean_env(**env))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_warning_is_off_and_the_memory_hooks_are_left_to_ucx():
    assert _env_after() == {"UCX_MEM_MMAP_HOOK_MODE": None, "UCX_WARN_UNUSED_ENV_VARS": "n"}


def test_the_user_s_settings_stand_and_a_loaded_ucx_is_left_alone():
    got = _env_after(UCX_WARN_UNUSED_ENV_VARS="y")
    assert got["UCX_WARN_UNUSED_ENV_VARS"] == "y"
    pytest.importorskip("ucxx")
    assert _env_after(loaded=True)["UCX_WARN_UNUSED_ENV_VARS"] != "n"


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
    """UCX's memory hooks through relocation tables (``UCX_MEM_MMAP_HOOK_MODE=reloc``) corrupt
    the heap of a process that runs JAX (``munmap_chunk(): invalid pointer`` at its exit): what
    wb sets must not do that."""
    pytest.importorskip("jax")
    pytest.importorskip("ucxx")
    out = subprocess.run([sys.executable, "-c", _JAX_AND_UCX], capture_output=True, text=True,
                         timeout=120, env=_clean_env(JAX_PLATFORMS="cpu"))
    assert out.returncode == 0 and out.stdout.strip().endswith("done"), out.stderr[-2000:]
    assert "invalid pointer" not in out.stderr
