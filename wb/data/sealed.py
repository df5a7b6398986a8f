"""Sealed bytes: everything wb writes to a file or a store carries a digest of its whole content,
checked before anything of it is decoded.

A sealed artefact is ``MAGIC``, its kind (a short name: ``plan``, ``rank part``, ``layouts``,
``record``, ``fp8 amax``, ``map cache``), its payload's length, a BLAKE2b digest of the payload,
then the payload. :func:`unseal` refuses, before decoding anything, bytes that are not sealed by
this wb, of another kind, cut short or longer than sealed, or whose payload no longer has its
digest: a flipped bit, a truncated file, a store that mangled a value. The error names where the
bytes came from (a file, a store key) and what to do, in the error class the caller gives (a
plan's :class:`wb.PlanError`, a layout's :class:`wb.SpecError`, a store record's
:class:`wb.TransferError`).

Examples:
    >>> data = seal("record", b'{"v": 1}')
    >>> unseal("record", data, where="store key `wb/roster`") == b'{"v": 1}'
    True
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
import zlib

from wb.errors import TransferError, WbError

__all__ = ["seal", "seal_head", "unseal", "unseal_stream", "seal_json", "unseal_json",
           "DECODE_ERRORS", "MAGIC", "DIGEST_BYTES"]

#: What decoding bytes of the right digest but of another layout raises (a payload written by
#: another version of wb under the same kind): callers turn these into their wb error.
DECODE_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError, EOFError,
                 OverflowError, NotImplementedError, OSError, zlib.error, zipfile.BadZipFile)

#: What every sealed artefact starts with (and its layout's version).
MAGIC = b"WBSEAL1\n"
#: Bytes of the BLAKE2b digest of the payload.
DIGEST_BYTES = 16


def _digest(payload) -> bytes:
    return hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest()


def seal_head(kind: str, payload) -> bytes:
    """What :func:`seal` puts before ``payload``: write it, then the payload, to seal a file
    without joining the two in memory."""
    payload = memoryview(payload).cast("B")
    k = kind.encode()
    if len(k) > 255:
        raise ValueError(f"a sealed kind has at most 255 bytes, got {len(k)}")
    return MAGIC + bytes([len(k)]) + k + len(payload).to_bytes(8, "little") + _digest(payload)


def seal(kind: str, payload) -> bytes:
    """``payload`` sealed as an artefact of ``kind`` (see the module doc).

    Args:
        kind: a short name of what the payload is (at most 255 bytes of UTF-8).
        payload: the bytes to seal (any bytes-like object).

    Returns:
        The sealed bytes.
    """
    payload = memoryview(payload).cast("B")
    return b"".join((seal_head(kind, payload), payload))


def unseal(kind: str, data, *, where: str, error: type[WbError] = TransferError,
           remedy: str = "") -> memoryview:
    """The payload of ``data``, sealed as a ``kind`` by :func:`seal`, once its digest matches.

    Args:
        kind: what ``data`` must be.
        data: the sealed bytes (bytes, bytearray or memoryview).
        where: where they came from, for the error (``"plan file `p.npz`"``, ``"store key
            `wb/part/3`"``).
        error: the :class:`wb.WbError` class to raise.
        remedy: what to do about it, appended to the error (e.g. ``"make the plan again"``).

    Returns:
        The payload (a memoryview into ``data``).

    Raises:
        WbError: of class ``error``: not sealed by this wb, another kind, cut short, longer
            than sealed, or corrupt (its digest does not match).
    """
    fix = f"; {remedy}" if remedy else ""
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        raise error(f"{where} must be bytes (a sealed {kind}), got {type(data).__name__}"
                    f"{fix}") from None
    n = len(MAGIC)
    if bytes(view[:n]) != MAGIC:
        raise error(f"{where} is not a {kind} sealed by this wb (another format, another "
                    f"version of wb, or not wb's at all){fix}")
    k = kind.encode()
    got = bytes(view[n + 1:n + 1 + view[n]]) if len(view) > n else b""
    if got != k:
        raise error(f"{where} is a sealed {got.decode(errors='replace')!r}, not a {kind}{fix}")
    at = n + 1 + len(k)
    head = at + 8 + DIGEST_BYTES
    if len(view) < head:
        raise error(f"{where} is cut short: {len(view)} bytes, not even a {kind}'s header{fix}")
    size = int.from_bytes(view[at:at + 8], "little")
    if len(view) - head != size:
        how = "cut short" if len(view) - head < size else "longer than it was sealed"
        raise error(f"{where} is {how}: the {kind} has {len(view) - head:,} bytes of the "
                    f"{size:,} it was sealed with{fix}")
    payload = view[head:]
    if _digest(payload) != bytes(view[at + 8:head]):
        raise error(f"{where} is corrupt: the {kind}'s bytes do not match their digest{fix}")
    return payload


def unseal_stream(kind: str, data: bytes, *, where: str, error: type[WbError] = TransferError,
                  remedy: str = "") -> io.BytesIO:
    """:func:`unseal`, as a binary stream over ``data`` placed at the payload's first byte (no
    copy of ``bytes``: ``np.load`` reads an ``.npz`` from it as it is)."""
    payload = unseal(kind, data, where=where, error=error, remedy=remedy)
    f = io.BytesIO(data)
    f.seek(len(memoryview(data).cast("B")) - len(payload))
    return f


def seal_json(kind: str, value) -> bytes:
    """``value`` (plain JSON data) as a sealed ``kind``: what wb's records in a store are.

    Examples:
        >>> unseal_json("record", seal_json("record", {"epoch": 2}), where="key `k`")
        {'epoch': 2}
    """
    return seal(kind, json.dumps(value, separators=(",", ":")).encode())


def unseal_json(kind: str, data, *, where: str, error: type[WbError] = TransferError,
                remedy: str = ""):
    """The value :func:`seal_json` sealed (see :func:`unseal` for the arguments and errors)."""
    payload = unseal(kind, data, where=where, error=error, remedy=remedy)
    try:
        return json.loads(bytes(payload).decode())
    except DECODE_ERRORS as e:
        fix = f"; {remedy}" if remedy else ""
        raise error(f"{where} holds a {kind} that is not JSON ({e}){fix}") from None
