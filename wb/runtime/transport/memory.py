"""Memory that another process of this host can read: what :mod:`~wb.runtime.transport.ipc`'s
one-sided messages are made of. A *memory* exports a buffer as ``(handle, offset)`` (or ``None``:
not exportable), opens a peer's handle once, copies ``nbytes`` at an offset of an opened one into
a local buffer (a token, or ``None``: it cannot, and the message goes over UCX), or several at
once (one token, or ``None``: the caller copies them one by one), and says when a token has
passed.

- :class:`CudaMemory`: legacy CUDA IPC handles of the allocations holding the bytes (the driver
  gives an allocation's range and buffer id), copied on a stream per sending peer by one launch
  of a kernel per group (:mod:`~wb.runtime.transport.copy_kernel`); or, for receives their
  caller can unpack, their unpacking kernels run on the opened memory instead (``unpack_many``).
- :class:`HostMemory`: a process id and an address, read with ``process_vm_readv`` (UCX's
  ``cma``): for hosts without GPUs, and for testing the protocol where there are none.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import logging
import os
import socket
import struct
from typing import Any

from wb.runtime.transport.copy_kernel import PieceCopier

__all__ = ["CudaMemory", "HostMemory", "host_id", "cma_usable", "HANDLE_BYTES"]

log = logging.getLogger(__name__)

HANDLE_BYTES = 64  # a cudaIpcMemHandle_t; a host handle is padded to it
# CUpointer_attribute values (cuda.h)
_BUFFER_ID, _RANGE_START, _RANGE_SIZE = 7, 11, 12


def host_id() -> str:
    """This host, as processes that can share memory see it: its name and boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


_IOV_MAX = 1024  # iovecs one process_vm_readv takes


class _Iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@functools.lru_cache(maxsize=1)
def cma_usable() -> bool:
    """Whether processes of this host may read each other's memory (``process_vm_readv``, UCX's
    ``cma``): Yama's ``ptrace_scope`` is 0 (or absent) and the call is not filtered (tried on
    this process's own memory)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            if f.read().strip() != "0":
                return False
    except OSError:
        pass  # no Yama
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        src, dst = ctypes.c_uint64(0x5742), ctypes.c_uint64(0)
        local = _Iov(ctypes.cast(ctypes.byref(dst), ctypes.c_void_p), 8)
        remote = _Iov(ctypes.cast(ctypes.byref(src), ctypes.c_void_p), 8)
        n = libc.process_vm_readv(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1,
                                  0)
    except (OSError, AttributeError):
        return False
    return n == 8 and dst.value == src.value


class HostMemory:
    """Host buffers of another process, read with ``process_vm_readv`` (UCX's ``cma``; needs
    :func:`cma_usable`). Copies are synchronous: each completes before
    the call returns."""

    name = "host"

    def __init__(self):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.process_vm_readv.restype = ctypes.c_ssize_t
        self._pid = os.getpid()

    def export(self, buf) -> tuple[bytes, int] | None:
        ai = getattr(buf, "__array_interface__", None)
        if ai is None or getattr(buf, "__cuda_array_interface__", None) is not None:
            return None
        return struct.pack("<q", self._pid).ljust(HANDLE_BYTES, b"\0"), int(ai["data"][0])

    def open(self, handle: bytes) -> Any:
        return struct.unpack_from("<q", handle)[0]

    def copy(self, buf, opened, offset: int, nbytes: int, peer: int):
        """Copies ``nbytes`` at ``offset`` of the opened memory into ``buf``: a token for
        :meth:`passed`, or ``None`` where the memory cannot be read (the caller falls back)."""
        ai = getattr(buf, "__array_interface__", None)
        if ai is None or getattr(buf, "__cuda_array_interface__", None) is not None:
            return None  # not host memory: the caller falls back over UCX
        dst = int(ai["data"][0])
        done = 0
        while done < nbytes:
            local = _Iov(dst + done, nbytes - done)
            remote = _Iov(offset + done, nbytes - done)
            n = self._libc.process_vm_readv(int(opened), ctypes.byref(local), 1,
                                            ctypes.byref(remote), 1, 0)
            if n <= 0:
                log.info("process_vm_readv from pid %s failed: errno %d", opened,
                         ctypes.get_errno())
                return None
            done += n
        return True

    def copy_many(self, items, peer: int):
        """:meth:`copy` of several ``(buf, opened, offset, nbytes)`` of one process in one
        ``process_vm_readv``: a token, or ``None`` (the caller copies them one by one)."""
        if len(items) > _IOV_MAX or len({int(it[1]) for it in items}) != 1:
            return None
        local, remote, total = (_Iov * len(items))(), (_Iov * len(items))(), 0
        for k, (buf, _, offset, nbytes) in enumerate(items):
            ai = getattr(buf, "__array_interface__", None)
            if ai is None or getattr(buf, "__cuda_array_interface__", None) is not None:
                return None
            local[k], remote[k] = _Iov(int(ai["data"][0]), nbytes), _Iov(offset, nbytes)
            total += nbytes
        n = self._libc.process_vm_readv(int(items[0][1]), local, len(items), remote, len(items),
                                        0)
        return True if n == total else None  # short: copied again one by one

    def passed(self, token) -> bool:
        return True

    def unexportable(self, buf) -> bool:
        """Whether ``buf`` is memory of the kind this channel moves that it cannot export: never
        for host arrays (any address of this process is readable)."""
        return False

    def new_round(self) -> None:
        pass

    def wait_all(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Failed:
    """A token of copies that failed once queued: asking whether they passed raises."""

    def __init__(self, error: Exception):
        self.error = error

    @property
    def done(self) -> bool:
        raise self.error


def _cuda_ptr(buf) -> int | None:
    """The device address of CUDA array ``buf``'s first byte, or ``None`` for other arrays: a
    CuPy array's own pointer (its ``__cuda_array_interface__`` builds a dict per call, microseconds
    each, and a rank copies hundreds of messages per update), else the interface's."""
    ptr = getattr(getattr(buf, "data", None), "ptr", None)
    if ptr is not None:
        return int(ptr)
    cai = getattr(buf, "__cuda_array_interface__", None)
    return None if cai is None else int(cai["data"][0])


class CudaMemory:
    """CUDA buffers of other processes of this host, through legacy CUDA IPC handles (CuPy's
    runtime calls; the allocation's range and buffer id from the driver): exported once per
    allocation (checked again once a round), opened once per handle, copied by the row copy
    kernel on a stream per sending peer, an event per launch."""

    name = "cuda"

    def __init__(self, device: int):
        import cupy

        self.cp, self.device = cupy, int(device)
        self._cuda = ctypes.CDLL("libcuda.so.1")
        attrs = self._cuda.cuPointerGetAttributes
        attrs.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_int),
                          ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64]
        self._attrs = attrs
        # this process's exports, by allocation: starts (sorted), and for each its end, handle,
        # buffer id and the round it was last checked in
        self._starts: list[int] = []
        self._exports: dict[int, list] = {}
        self._round = 0
        self._opened: dict[bytes, int] = {}  # handle -> mapped start
        self._used: set[bytes] = set()  # handles copied from since the last round
        self._streams: dict[int, Any] = {}
        self._rows: Any = False  # the row copy kernel's launcher (None: none here; False: not yet)

    def _describe(self, ptr: int) -> tuple[int, int, int] | None:
        """(start, size, buffer id) of the allocation holding ``ptr``: one driver call."""
        kinds = (ctypes.c_int * 3)(_BUFFER_ID, _RANGE_START, _RANGE_SIZE)
        bid, start, size = ctypes.c_uint64(0), ctypes.c_uint64(0), ctypes.c_uint64(0)
        out = (ctypes.c_void_p * 3)(ctypes.addressof(bid), ctypes.addressof(start),
                                    ctypes.addressof(size))
        if self._attrs(3, kinds, out, ctypes.c_uint64(ptr)) != 0 or not size.value:
            return None
        return start.value, size.value, bid.value

    def export(self, buf) -> tuple[bytes, int] | None:
        ptr = _cuda_ptr(buf)
        if ptr is None:
            return None
        k = bisect.bisect_right(self._starts, ptr) - 1
        if k >= 0:
            start = self._starts[k]
            end, handle, bid, checked = self._exports[start]
            if ptr < end:
                if checked == self._round:  # None: an allocation the driver would not export
                    return None if handle is None else (handle, ptr - start)
                # first use this round: still the same allocation? (another at the same address
                # has another buffer id, and another handle)
                now = self._describe(ptr)
                if now is not None and now[0] == start and now[2] == bid:
                    self._exports[start][3] = self._round
                    return None if handle is None else (handle, ptr - start)
        got = self._describe(ptr)
        if got is None:
            return None
        start, size, bid = got
        try:
            handle = bytes(self.cp.cuda.runtime.ipcGetMemHandle(start))
        except Exception as e:  # noqa: BLE001 - not exportable (e.g. a VMM allocation): UCX
            # (remembered: the next sends from it go over UCX without asking the driver again)
            log.info("CUDA memory at %#x cannot be exported (%s): sent over UCX", ptr, e)
            handle = None
        # drop exports this allocation overlaps (freed ones whose addresses it reuses)
        for s in [s for s in self._starts if s < start + size and self._exports[s][0] > start]:
            self._starts.remove(s)
            del self._exports[s]
        bisect.insort(self._starts, start)
        self._exports[start] = [start + size, handle, bid, self._round]
        return None if handle is None else (handle, ptr - start)

    def unexportable(self, buf) -> bool:
        """Whether ``buf`` is CUDA memory without an IPC handle (an allocation of the virtual
        memory API or of a stream-ordered pool, as JAX's are): a message from it would go over
        UCX tags, whose path from such memory is far slower than a device copy into staging."""
        return _cuda_ptr(buf) is not None and self.export(buf) is None

    def open(self, handle: bytes) -> Any:
        start = self._opened.get(handle)
        if start is None:
            try:
                with self.cp.cuda.Device(self.device):
                    start = self.cp.cuda.runtime.ipcOpenMemHandle(handle, 1)  # lazy peer access
            except Exception as e:  # noqa: BLE001 - the caller nacks: the message goes over UCX
                log.info("a peer's CUDA IPC handle cannot be opened here (%s)", e)
                return None
            self._opened[handle] = start
        self._used.add(handle)
        return start

    def copy(self, buf, opened, offset: int, nbytes: int, peer: int):
        return self.copy_many([(buf, opened, offset, nbytes)], peer)

    def copy_many(self, items, peer: int):
        """:meth:`copy` of several ``(buf, opened, offset, nbytes)`` on ``peer``'s stream, all in
        one launch of the row copy kernel (:class:`~wb.runtime.transport.copy_kernel.PieceCopier`),
        or, where it cannot be made, one ``cudaMemcpyAsync`` each: a token (an event), or
        ``None`` where a copy cannot be queued (the caller falls back)."""
        rows = []
        for buf, opened, offset, nbytes in items:
            dst = _cuda_ptr(buf)
            if dst is None:
                return None
            rows.append((dst, opened + offset, nbytes))
        cp = self.cp
        try:
            with cp.cuda.Device(self.device):  # whichever device the calling thread is on
                stream = self._stream(peer)
                copier = self._copier()
                if copier is not None:
                    return copier.launch(rows, stream)
                for dst, src, nbytes in rows:
                    cp.cuda.runtime.memcpyAsync(dst, src, nbytes, 4, stream.ptr)
                event = cp.cuda.Event(block=False, disable_timing=True)
                event.record(stream)
                return event
        except Exception as e:  # noqa: BLE001 - the caller nacks: the messages go over UCX
            log.info("CUDA IPC copies from peer %d failed (%s)", peer, e)
            return None

    def copy_hashed(self, items, peer: int):
        """:meth:`copy_many` of ``((hasher, key), buf, opened, offset, nbytes)`` items by their
        hashers, which take each message's checksum as they copy it: a hasher's items handed
        to its ``copy_many([(key, destination, source, bytes), ...], stream)`` at once, on
        ``peer``'s stream. A token as :meth:`_in_groups` gives (``None``: the caller copies
        them plainly, hashed after)."""
        by: dict[int, tuple] = {}
        for (hasher, key), buf, opened, offset, nbytes in items:
            dst = _cuda_ptr(buf)
            if dst is None:
                return None
            by.setdefault(id(hasher), (hasher, []))[1].append((key, dst, opened + offset,
                                                                nbytes))
        return self._in_groups(by, peer, lambda h, rows, stream: h.copy_many(rows, stream),
                               "copying and hashing")

    def unpack_many(self, items, peer: int):
        """Messages unpacked by their receivers' kernels straight from ``peer``'s memory, on its
        stream: ``((unpacker, key), opened, offset, nbytes)`` each, an unpacker's keys handed to
        its ``unpack_many([(key, address), ...])`` at once. A token as :meth:`_in_groups` gives
        (``None``: the caller copies them instead; the unpacks may run twice, to the same
        bytes)."""
        by: dict[int, tuple] = {}
        for (unpacker, key), opened, offset, _ in items:
            by.setdefault(id(unpacker), (unpacker, []))[1].append((key, opened + offset))
        return self._in_groups(by, peer, lambda u, keyed, _: u.unpack_many(keyed),
                               "unpacking in place")

    def _in_groups(self, by: dict, peer: int, run, what: str):
        """``run(owner, rows, stream)`` for each ``(owner, rows)`` of ``by`` on ``peer``'s
        stream: an event behind them; ``None`` (logged) where the first failed (nothing was
        queued: the caller moves the messages plainly); a token that fails their receives where
        a later step failed (what ran took checksums: run again, they would cancel out)."""
        cp, queued = self.cp, False
        try:
            with cp.cuda.Device(self.device):
                stream = self._stream(peer)
                with stream:
                    for owner, rows in by.values():
                        run(owner, rows, stream)
                        queued = True
                event = cp.cuda.Event(block=False, disable_timing=True)
                event.record(stream)
                return event
        except Exception as e:  # noqa: BLE001 - the caller moves them plainly, or they fail
            if queued:
                return _Failed(e)
            log.warning("messages from peer %d: %s failed (%s); copied plainly", peer, what, e)
            return None

    def _copier(self):
        """The row copy kernel's launcher on this device, made at first use; ``None`` (logged
        once) where it cannot be compiled: copies are then ``cudaMemcpyAsync`` calls."""
        if self._rows is False:
            try:
                self._rows = PieceCopier(self.cp)
            except Exception as e:  # noqa: BLE001 - CuPy without NVRTC, for one
                log.warning("the CUDA row copy kernel cannot be made here (%s): one-sided "
                            "copies go one cudaMemcpyAsync each (about half the speed)", e)
                self._rows = None
        return self._rows

    def _stream(self, peer: int):
        stream = self._streams.get(peer)
        if stream is None:
            stream = self._streams[peer] = self.cp.cuda.Stream(non_blocking=True)
        return stream

    def passed(self, token) -> bool:
        return token.done

    def wait_all(self) -> None:
        for s in self._streams.values():
            s.synchronize()

    def new_round(self) -> None:
        """Checks this process's exports again at first use (allocations may have changed since)
        and closes the
        handles no copy used since the last round (after every copy has finished)."""
        self._round += 1
        stale = [h for h in self._opened if h not in self._used]
        if stale:
            self.wait_all()
            for h in stale:
                self._close(h)
        self._used = set()

    def _close(self, handle: bytes) -> None:
        start = self._opened.pop(handle)
        try:
            self.cp.cuda.runtime.ipcCloseMemHandle(start)
        except Exception:  # noqa: BLE001 - closing anyway (its process may be gone)
            log.debug("closing a CUDA IPC mapping failed", exc_info=True)

    def close(self) -> None:
        self.wait_all()
        for h in list(self._opened):
            self._close(h)
