"""A job key: every store record signed with it, and refused without it.

Any process that reaches a job's store can write to it: a join request, a plan part, a version's
final record, a worker's address. With a key (``key=`` here, or the environment's
``WB_JOB_KEY``), :class:`KeyedStore` signs every value it puts (HMAC-SHA256 over the key's
name and the value, so a signed value moved under another name is refused too) and refuses,
with :class:`wb.AuthError` naming the key, every value it reads that is not signed with the
same key. A worker then takes nothing from a process without the key: no address to connect to,
no join request (the trainers' leader logs it and goes on), no record; a transport keyed so
(:func:`tag_secret`) matches no message of theirs, and every peer answers a challenge
(:mod:`wb.runtime.transport.challenge`) before any message of an update goes to or from it. The values are not
encrypted: anyone who can read the store reads them; and anyone who can write it can still
overwrite a record (which is then refused, not taken).

Without a key nothing is signed, and :func:`keyed` says so once per process.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import warnings

from wb.errors import AuthError, WbWarning

__all__ = ["KeyedStore", "keyed", "job_key", "tag_secret", "MAGIC"]

#: What a signed value starts with (then the 32-byte signature, then the value).
MAGIC = b"wbk1"
_MAC = 32


def job_key(key: bytes | str | None = None) -> bytes | None:
    """The job's key: ``key``, else the environment's ``WB_JOB_KEY``, else ``None``."""
    key = key if key is not None else os.environ.get("WB_JOB_KEY") or None
    if key is None:
        return None
    key = key.encode() if isinstance(key, str) else bytes(key)
    if len(key) < 16:
        raise AuthError("a job key must have at least 16 bytes (e.g. "
                        "`python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return key


class KeyedStore:
    """A store (any :class:`wb.Store`) whose every value is signed with a job key.

    Args:
        store: the store to wrap.
        key: the job's key (at least 16 bytes; a ``str`` is taken as UTF-8).

    Examples:
        >>> s = KeyedStore(__import__("wb").MemoryStore(), "0123456789abcdef")
        >>> s.set("a", b"1"); s.get("a", timeout=1)
        b'1'
    """

    def __init__(self, store, key: bytes | str):
        self.store, self.key = store, job_key(key)
        limit = getattr(store, "max_value_bytes", None)
        if limit is not None:  # set_large cuts values to fit, signature included
            self.max_value_bytes = limit - len(MAGIC) - _MAC

    def _mac(self, key: str, value: bytes) -> bytes:
        return hmac.new(self.key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: bytes) -> None:
        value = bytes(value)
        self.store.set(key, MAGIC + self._mac(key, value) + value)

    def get(self, key: str, timeout: float) -> bytes:
        raw = bytes(self.store.get(key, timeout))
        head, mac, value = raw[:len(MAGIC)], raw[len(MAGIC):len(MAGIC) + _MAC], \
            raw[len(MAGIC) + _MAC:]
        if head != MAGIC or not hmac.compare_digest(mac, self._mac(key, value)):
            what = ("is not signed" if head != MAGIC else "is signed with another key")
            err = AuthError(f"rendezvous: the value of key `{key}` {what}: written by a "
                            f"process without this job's key (WB_JOB_KEY); refused")
            warnings.warn(str(err), WbWarning, stacklevel=2)  # once per key (Python's filter)
            raise err
        return value

    def __repr__(self) -> str:
        return f"KeyedStore({self.store!r})"


def keyed(store, key: bytes | str | None = None, *, transport=None):
    """``store`` signed with the job's key (``key``; else the key of ``transport``'s store, a
    :class:`wb.UcxTransport` made with ``key=``; else ``WB_JOB_KEY``): a :class:`KeyedStore`,
    or ``store`` itself when it is one already or there is no key (then a warning, once per
    process, that nothing keeps a stranger out). Where no transport is at hand
    (:func:`wb.agree_parts`, joining), pass a :class:`KeyedStore` or set ``WB_JOB_KEY``."""
    if isinstance(store, KeyedStore) or store is None:
        return store
    while key is None and transport is not None:  # through wrappers (.inner) to the store
        st = getattr(transport, "store", None)
        key = st.key if isinstance(st, KeyedStore) else None
        transport = getattr(transport, "inner", None)
    k = job_key(key)
    if k is None:  # once per process: Python's warning filter shows each message once
        warnings.warn("no job key (WB_JOB_KEY): any process that reaches the rendezvous store "
                      "can join, publish an address or write records this job takes",
                      WbWarning)
        return store
    return KeyedStore(store, k)


def tag_secret(store, session: str) -> int:
    """64 bits a keyed transport XORs every tag with (0 without a key): drawn from the key of
    ``store`` (a :class:`KeyedStore`) and ``session``, so a process without the key cannot
    name a tag any receive of the job waits for."""
    if not isinstance(store, KeyedStore):
        return 0
    mac = hmac.new(store.key, b"wb tags\0" + session.encode(), hashlib.sha256).digest()
    return int.from_bytes(mac[:8], "little")
