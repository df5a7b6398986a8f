"""Rendezvous: a small key -> bytes store the workers share, over stores that already exist.

Workers publish their UCX worker addresses and plan fingerprints here and read their peers'.
Values are bytes: nothing read from a store is ever unpickled, and wb's records (JSON,
:func:`set_record`) and the headers of large values (:func:`set_large`) are sealed with a digest
(:mod:`wb.data.sealed`), so a value the store mangled is refused with the key's name. No
home-made server: the adapters wrap an in-process dict (threads, notebooks), a shared directory
(processes of one machine or a shared filesystem), ``torch.distributed.TCPStore`` and JAX's
distributed key-value client, duck-typed so ``wb`` imports neither framework, and Ray's key-value
store (imported only when a :class:`RayStore` is made).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Protocol, runtime_checkable

from wb.data.sealed import seal_json, unseal_json
from wb.errors import TransferError

__all__ = ["Store", "MemoryStore", "DirectoryStore", "TorchStore", "JaxStore", "RayStore",
           "CountingStore",
           "set_large", "get_large", "value_limit", "set_record", "get_record", "read_record"]

#: What to do about a value the store mangled.
_CORRUPT = "the rendezvous store is corrupt or shared with another job: start the job again"


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
        if not isinstance(path, (str, os.PathLike)):
            raise TransferError(f"DirectoryStore needs a directory's path (str or os.PathLike), "
                                f"got {type(path).__name__}")
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
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _timeout(key, timeout) from None
                time.sleep(min(self.poll_s, left))  # a short timeout is a short look


class TorchStore:
    """Adapter over a ``torch.distributed`` store (``TCPStore``, ``FileStore``, ...).

    Args:
        store: the ``torch.distributed`` store every process shares.
        prefix: put before every key (keeps wb's keys apart from the job's own).
        max_value_bytes: larger values go as chunks (:func:`set_large`); a TCPStore server holds
            every value in memory and answers one request at a time, so big values are cut.
    """

    def __init__(self, store, *, prefix: str = "wb/", max_value_bytes: int = 64 << 20):
        self.store, self.prefix = store, prefix
        self.max_value_bytes = max_value_bytes

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
        max_value_bytes: larger values go as chunks (:func:`set_large`): the client talks gRPC,
            whose default message limit is 4 MiB.
    """

    def __init__(self, client, *, prefix: str = "wb/", max_value_bytes: int = 2 << 20):
        self.client, self.prefix = client, prefix
        self.max_value_bytes = max_value_bytes

    def set(self, key: str, value: bytes) -> None:
        # overwrite, as every store here does (heartbeats write one key again and again)
        self.client.key_value_set_bytes(self.prefix + key, bytes(value), allow_overwrite=True)

    def get(self, key: str, timeout: float) -> bytes:
        try:
            return bytes(self.client.blocking_key_value_get_bytes(self.prefix + key,
                                                                  int(timeout * 1000)))
        except Exception as e:  # noqa: BLE001 - the client raises XlaRuntimeError on timeout
            raise _timeout(key, timeout) from e


class RayStore:
    """Ray's own key-value store (the cluster's GCS, ``ray.experimental.internal_kv``): the
    driver and actors of one Ray cluster, and processes outside it that joined it with
    ``ray.init(address=...)``, meet there. Ray is imported when one is made, never by
    ``import wb``; the process must have joined the cluster (``ray.init``) first.

    Args:
        namespace: Ray's key-value namespace (keeps jobs of one cluster apart; default
            ``"wb"``).
        prefix: put before every key (keeps wb's keys apart from the job's own).
        poll_s: the longest wait between looks for a key not there yet (Ray's store has no
            blocking get: looks start 0.5 ms apart and back off to this).
        max_value_bytes: larger values go as chunks (:func:`set_large`); Ray's GCS holds every
            value in its memory.

    Raises:
        TransferError: Ray is not installed, or this process has not joined a cluster.
    """

    def __init__(self, *, namespace: str = "wb", prefix: str = "wb/", poll_s: float = 0.02,
                 max_value_bytes: int = 16 << 20):
        try:
            from ray.experimental import internal_kv
        except ImportError as e:
            raise TransferError("wb.RayStore needs Ray: pip install 'weightbridge[ray]'") from e
        if not internal_kv._internal_kv_initialized():
            raise TransferError("wb.RayStore: this process has not joined a Ray cluster; call "
                                "ray.init() (or ray.init(address=...)) before making the store")
        self._kv, self.namespace, self.prefix = internal_kv, namespace, prefix
        self.poll_s, self.max_value_bytes = poll_s, max_value_bytes

    def set(self, key: str, value: bytes) -> None:
        self._kv._internal_kv_put((self.prefix + key).encode(), bytes(value), overwrite=True,
                                  namespace=self.namespace)

    def get(self, key: str, timeout: float) -> bytes:
        k, deadline, wait = (self.prefix + key).encode(), time.monotonic() + timeout, 5e-4
        while True:
            value = self._kv._internal_kv_get(k, namespace=self.namespace)
            if value is not None:
                return bytes(value)
            left = deadline - time.monotonic()
            if left <= 0:
                raise _timeout(key, timeout)
            time.sleep(min(wait, left))
            wait = min(2 * wait, self.poll_s)


def value_limit(store) -> int | None:
    """The largest value ``store`` takes in one key (its ``max_value_bytes``; None: no limit)."""
    return getattr(store, "max_value_bytes", None)


def set_large(store, key: str, value: bytes, *, max_value_bytes: int | None = None) -> int:
    """Puts a value of any size: chunks of at most ``max_value_bytes`` under ``key#0``,
    ``key#1``, ..., then ``key`` itself, a small JSON header naming them (written last, so a
    reader that finds ``key`` finds every chunk). :func:`get_large` reads it back.

    Args:
        store: any :class:`Store`.
        key: the key.
        value: the bytes.
        max_value_bytes: the largest chunk (default: the store's own ``max_value_bytes``, else
            one chunk).

    Returns:
        The bytes written to the store (value and header).

    Raises:
        TransferError: ``max_value_bytes`` is not positive.

    Examples:
        >>> s = MemoryStore(); set_large(s, "k", b"abcde", max_value_bytes=2) > 5
        True
        >>> get_large(s, "k", timeout=1), s.get("k#2", timeout=1)
        (b'abcde', b'e')
    """
    limit = max_value_bytes if max_value_bytes is not None else value_limit(store)
    value = memoryview(bytes(value))
    n = len(value)
    if limit is not None and limit <= 0:
        raise TransferError(f"max_value_bytes must be positive, got {limit}")
    step = n if limit is None else limit
    k = 0 if n == 0 else -(-n // max(step, 1))
    for i in range(k):
        store.set(f"{key}#{i}", bytes(value[i * step:(i + 1) * step]))
    header = seal_json("chunked value header", {"chunks": k, "nbytes": n})
    store.set(key, header)
    return n + len(header)


def get_large(store, key: str, timeout: float) -> bytes:
    """The value :func:`set_large` put under ``key``, waiting up to ``timeout`` seconds for it.

    Raises:
        TransferError: ``key`` not published in time, or its header or chunks are not
            :func:`set_large`'s (a value put with ``store.set``).
    """
    deadline = time.monotonic() + timeout
    raw = store.get(key, timeout)
    head = unseal_json("chunked value header", raw, where=f"rendezvous: key `{key}`",
                       remedy="written with store.set, not set_large? Else " + _CORRUPT)
    try:
        k, n = int(head["chunks"]), int(head["nbytes"])
    except (KeyError, TypeError, ValueError):
        raise TransferError(f"rendezvous: key `{key}` does not hold a chunked value's header; "
                            f"{_CORRUPT}") from None
    out = b"".join(store.get(f"{key}#{i}", max(deadline - time.monotonic(), 0.001))
                   for i in range(k))
    if len(out) != n:
        raise TransferError(f"rendezvous: key `{key}` should hold {n} bytes in {k} chunks, got "
                            f"{len(out)}; two sessions wrote the same key? Use another name")
    return out


def set_record(store, key: str, value) -> None:
    """Puts ``value`` (plain JSON data: a membership or version record) under ``key``, sealed
    with a digest (:func:`get_record` refuses it if the store changes a bit of it)."""
    store.set(key, seal_json("record", value))


def read_record(raw: bytes, key: str):
    """The record :func:`set_record` put under ``key``, from the bytes read there.

    Raises:
        TransferError: the bytes are not such a record (corrupt, cut short, another format);
            names ``key``.
    """
    return unseal_json("record", raw, where=f"rendezvous: key `{key}`", remedy=_CORRUPT)


def get_record(store, key: str, timeout: float):
    """The record :func:`set_record` put under ``key``, waiting up to ``timeout`` seconds.

    Raises:
        TransferError: not published in time, or not such a record (see :func:`read_record`).
    """
    return read_record(store.get(key, timeout), key)


class CountingStore:
    """Wraps a store and counts the bytes put into it and read out of it (for the set-up bench).

    Args:
        store: the store to wrap.
    """

    def __init__(self, store):
        self.store = store
        self.max_value_bytes = value_limit(store)
        self.bytes_set = 0
        self.bytes_got = 0
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)
        with self._lock:
            self.bytes_set += len(value)

    def get(self, key: str, timeout: float) -> bytes:
        value = self.store.get(key, timeout)
        with self._lock:
            self.bytes_got += len(value)
        return value
