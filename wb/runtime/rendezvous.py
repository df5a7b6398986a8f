"""Rendezvous: a small key -> bytes store the workers share, over stores that already exist.

Workers publish their UCX worker addresses and plan fingerprints here and read their peers'.
Values are bytes (JSON or raw numpy bytes): nothing read from a store is ever unpickled. No
home-made server: the adapters wrap an in-process dict (threads, notebooks), a shared directory
(processes of one machine or a shared filesystem), ``torch.distributed.TCPStore`` and JAX's
distributed key-value client, duck-typed so ``wb`` imports neither framework.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Protocol, runtime_checkable

from wb.errors import TransferError

__all__ = ["Store", "MemoryStore", "DirectoryStore", "TorchStore", "JaxStore"]


@runtime_checkable
class Store(Protocol):
    """Set a key once; get it, waiting up to ``timeout`` seconds for another worker to set it."""

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout: float) -> bytes: ...


def _timeout(key: str, timeout: float) -> TransferError:
    return TransferError(f"rendezvous: key `{key}` was not published within {timeout:.1f} s; "
                         f"is every worker of the plan running and using the same store?")


class MemoryStore:
    """A dict shared by threads of one process (notebooks, tests, the local transport).

    Examples:
        >>> s = MemoryStore(); s.set("a", b"1"); s.get("a", timeout=1)
        b'1'
    """

    def __init__(self):
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cv:
            self._data[key] = bytes(value)
            self._cv.notify_all()

    def get(self, key: str, timeout: float) -> bytes:
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._data, timeout):
                raise _timeout(key, timeout)
            return self._data[key]


class DirectoryStore:
    """Files in a directory every worker can read (one machine, or a shared filesystem).

    Each key is written to a temporary file and renamed into place, so a reader never sees half a
    value.

    Args:
        path: the directory (made if missing); one per session.
        poll_s: seconds between looks for a key not there yet.

    Examples:
        >>> import tempfile
        >>> s = DirectoryStore(tempfile.mkdtemp()); s.set("a/b", b"1"); s.get("a/b", timeout=1)
        b'1'
    """

    def __init__(self, path: str | os.PathLike, *, poll_s: float = 0.005):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.poll_s = poll_s

    def _file(self, key: str) -> Path:
        return self.path / key.replace("/", "%")

    def set(self, key: str, value: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, self._file(key))

    def get(self, key: str, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        f = self._file(key)
        while True:
            try:
                return f.read_bytes()
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise _timeout(key, timeout) from None
                time.sleep(self.poll_s)


class TorchStore:
    """Adapter over a ``torch.distributed`` store (``TCPStore``, ``FileStore``, ...).

    Args:
        store: the ``torch.distributed`` store every process shares.
        prefix: put before every key (keeps wb's keys apart from the job's own).
    """

    def __init__(self, store, *, prefix: str = "wb/"):
        self.store, self.prefix = store, prefix

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self.prefix + key, bytes(value))

    def get(self, key: str, timeout: float) -> bytes:
        try:
            self.store.wait([self.prefix + key], timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - torch raises its own timeout types
            raise _timeout(key, timeout) from e
        return bytes(self.store.get(self.prefix + key))


class JaxStore:
    """Adapter over JAX's distributed key-value client
    (``jax._src.distributed.global_state.client`` after ``jax.distributed.initialize``).

    Args:
        client: the key-value client every process shares.
        prefix: put before every key (keeps wb's keys apart from the job's own).
    """

    def __init__(self, client, *, prefix: str = "wb/"):
        self.client, self.prefix = client, prefix

    def set(self, key: str, value: bytes) -> None:
        self.client.key_value_set_bytes(self.prefix + key, bytes(value))

    def get(self, key: str, timeout: float) -> bytes:
        try:
            return bytes(self.client.blocking_key_value_get_bytes(self.prefix + key,
                                                                  int(timeout * 1000)))
        except Exception as e:  # noqa: BLE001 - the client raises XlaRuntimeError on timeout
            raise _timeout(key, timeout) from e
