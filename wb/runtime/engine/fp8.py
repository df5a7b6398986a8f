"""A trainer's quantisation before each update: its blocks of the declared tensors, gathered from
its live buffers, quantised into the buffers the plan sends (:mod:`wb.algorithms.fp8.tasks`).
Blocks it holds only a part of take two steps: each part's ``amax`` first, then, once the
caller has exchanged those with the other holders (``exchange``), the part encoded with the
whole block's ``amax``.

Host buffers use numpy (:func:`wb.algorithms.fp8.tasks.quantize_buffers`). CUDA buffers use one
CUDA kernel on their device (:mod:`wb.runtime.engine.quant_kernel`) over a table of every block
(:func:`block_table`): a few launches for all tasks, in the order the update sends their
buffers, on a stream of the quantiser's own, each buffer's event after the last launch that
writes it. The kernel follows the rule of :mod:`wb.data.fp8` bit for bit (in float32,
subnormals kept), reads each source element twice (the second time from cache) and writes it
once: no temporaries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from wb.algorithms.fp8.tasks import Quantized, combine_amax, partial_amax, quantize_buffers
from wb.data.sealed import seal, unseal
from wb.errors import TransferError
from wb.runtime.engine.casts import xp_dtype
from wb.runtime.engine.inflight import recorded
from wb.runtime.engine.quant_kernel import (GIVEN, PARTS, ROW, SLOT, TASK, THREADS, WHOLE,
                                            quant_kernel)

__all__ = ["Quantiser", "amax_bytes", "amax_from_bytes"]


class Quantiser:
    """Trainer ``rank``'s quantisation: its output buffers (zeroed, each on the device and array
    module of the buffer its blocks are read from) and, on CUDA, its tables of blocks there.

    On a GPU every block of every task is one row of a table (:func:`block_table`), and the
    rows, in the order an update first sends their buffers, are quantised by a few launches of
    one kernel of about ``chunk`` elements each: a launch fills the device whatever the tasks'
    sizes (a launch per task leaves most of it idle for small tensors, and costs its Python
    call).

    Args:
        q: from :func:`wb.algorithms.fp8.tasks.quantize_layouts`.
        rank: the trainer's rank.
        live: ``{name: (xp, array)}`` of its buffers (:func:`wb.runtime.engine.buffers.as_array`).
        chunk: elements quantised per kernel launch on a GPU (about; a launch also ends where
            the source dtype changes).

    Attributes:
        buffers: ``{name: array}`` to add to the trainer's buffers (what the plan sends).
    """

    def __init__(self, q: Quantized, rank: int, live: Mapping[str, tuple[Any, Any]], *,
                 chunk: int = 1 << 26):
        self.q, self.rank = q, rank
        bh, bw = q.scaled.decl.block
        self.step = max(1, chunk // (bh * bw))  # blocks quantised by one launch on a GPU
        self.tasks = q.tasks.get(rank, ())
        shapes = q.shapes(rank)
        self.buffers: dict[str, Any] = {}
        for task in self.tasks:
            xp, src = live[task.source]
            for name in (task.weights, task.scales):
                if name in self.buffers:  # a quantised copy serves every tensor in its buffer
                    continue
                shape, dtype = shapes[name]
                if xp is np:
                    self.buffers[name] = np.zeros(shape, xp_dtype(np, dtype))
                else:
                    with xp.cuda.Device(src.device.id):
                        self.buffers[name] = xp.zeros(shape, xp_dtype(xp, dtype))
        # the tasks whose buffers are on the host (numpy), decided once: devices do not change
        host = tuple(t for t in self.tasks if live[t.source][0] is np)
        self._host = Quantized(q.scaled, q.trainers, {rank: host}) if host else None
        # the CUDA tasks: task index -> (array module, device)
        self._cuda = {i: (live[t.source][0], live[t.source][1].device.id)
                      for i, t in enumerate(self.tasks) if live[t.source][0] is not np}
        self._tables: tuple | None = None  # (order, {device: _OnDevice}), made at first use
        self._keep: list = []  # what the kernels queued last read (sources, task rows)

    @property
    def parts(self) -> bool:
        """Whether it holds blocks in part (``run`` then needs ``exchange``)."""
        return any(t.part for t in self.tasks)

    def run(self, live: Mapping[str, tuple[Any, Any]], exchange=None, *,
            order: list[str] | None = None) -> None:
        """Fills :attr:`buffers` from the ``live`` buffers (as given at set-up, or new ones of the
        same shapes), finished when this returns.

        Args:
            live: ``{name: (xp, array)}`` of its buffers.
            exchange: where it holds blocks in part: ``exchange(keys, amax)`` gets its parts'
                ``amax`` (:func:`wb.algorithms.fp8.tasks.partial_amax`) and returns
                ``(keys, amax)`` over the whole blocks, every other holder's parts included.
            order: as :meth:`launch`.
        """
        for ev in self.launch(live, exchange, order=order).values():
            ev.synchronize()

    def prepare(self, order: list[str] | None = None) -> None:
        """Makes the CUDA tasks' tables for ``order`` (see :meth:`launch`) now, as the first
        launch in that order would: their rows on the host and on the devices take milliseconds
        per GB of weights, which then stay out of the first update."""
        self._on_devices(order)

    def launch(self, live: Mapping[str, tuple[Any, Any]], exchange=None, *,
               order: list[str] | None = None) -> dict[str, Any]:
        """Starts filling :attr:`buffers` from the ``live`` buffers: host tasks are done when
        this returns; CUDA blocks are queued, in the order their buffers are first sent, a few
        launches of about ``chunk`` elements each, and each output buffer gets the event after
        the last launch that writes it (what an update waits for before it sends from that
        buffer: :meth:`wb.runtime.engine.program.Program.run`'s ``ready``).

        Args:
            live, exchange: as :meth:`run` (blocks held in part are exchanged first, at once).
            order: output buffer names in the order an update first sends from them: their
                blocks are queued in that order (others after).

        Returns:
            ``{output buffer name: event}`` of the CUDA tasks (``.done``, ``.synchronize()``).
        """
        tables = self._on_devices(order)
        amax = None
        if self.parts:
            if exchange is None:
                raise TransferError(f"rank {self.rank} holds FP8 blocks in part: quantising them "
                                    f"needs the other holders' amax (exchange=)")
            amax = exchange(*self._partial_amax(live))
        if self._host is not None:
            host = self._host.tasks[self.rank]
            quantize_buffers(self._host, self.rank, {t.source: live[t.source][1] for t in host},
                             out={n: self.buffers[n] for t in host for n in (t.weights, t.scales)},
                             amax=amax)
        ready: dict[str, Any] = {}
        keep = []
        for dev in tables.values():
            with dev.xp.cuda.Device(dev.device):
                if dev.parts is not None:  # the whole blocks' amax, where the kernels read it
                    with dev.stream:
                        dev.amax[dev.parts_slot] = dev.xp.asarray(
                            amax[1][np.searchsorted(amax[0], dev.parts_keys)])
                keep += dev.queue(self, live, ready)
        self._keep = keep
        return ready

    def _on_devices(self, order: list[str] | None) -> dict[int, "_OnDevice"]:
        """The CUDA tasks' tables on their devices, in ``order``'s order: made once (again
        only for another order)."""
        key = tuple(order or ())
        if self._tables is None or self._tables[0] != key:
            first = {n: k for k, n in enumerate(key)}
            tasks = sorted(self._cuda, key=lambda i: (
                min(first.get(self.tasks[i].weights, len(first)),
                    first.get(self.tasks[i].scales, len(first))), i))
            by_device: dict[int, list[int]] = {}
            for i in tasks:
                by_device.setdefault(self._cuda[i][1], []).append(i)
            self._tables = (key, {d: _OnDevice(self, self._cuda[ix[0]][0], d, ix)
                                  for d, ix in by_device.items()})
        return self._tables[1]

    def _partial_amax(self, live) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, amax)`` of the parts it holds, on the host and on its devices."""
        out = []
        if self._host is not None:
            host = self._host.tasks[self.rank]
            out.append(partial_amax(self._host, self.rank,
                                    {t.source: live[t.source][1] for t in host}))
        tables = self._on_devices(self._tables[0] if self._tables else None)
        keep = []
        for dev in tables.values():  # every kernel queued first, then read back
            if dev.parts is not None:
                with dev.xp.cuda.Device(dev.device):
                    keep += dev.queue(self, live, None)
        for dev in tables.values():
            if dev.parts is not None:
                with dev.xp.cuda.Device(dev.device):
                    with dev.stream:
                        out.append((dev.parts_keys, dev.xp.asnumpy(dev.amax[dev.parts_slot])))
        del keep  # read back: the kernels are done
        return combine_amax(out)


class _OnDevice:
    """A quantiser's tasks on one device: their blocks' rows there (:func:`block_table`), the
    launches over them, the amax of parts, and the task rows of the last sources seen."""

    def __init__(self, qz: Quantiser, xp, device: int, tasks: list[int]):
        self.xp, self.device, self.tasks = xp, device, tasks
        scaled = qz.q.scaled
        self.fmt, self.block = scaled.decl.format, scaled.decl.block
        mine = [qz.tasks[i] for i in tasks]
        rows, gather = block_table(mine, *self.block)
        dtypes = [scaled.trainer_spec.dtype(scaled.names[t.tensor]) for t in mine]
        part = np.array([mine[t].part for t in rows[:, 0]], bool)
        with xp.cuda.Device(device):
            self.rows = xp.asarray(rows)
            self.gather = xp.asarray(gather if gather.size else np.full(1, -1, np.int64))
            self.amax = xp.zeros(max(len(rows), 1), np.float64)  # a slot per row: parts' amax
            self.parts = xp.asarray(rows[part]) if part.any() else None
            self.parts_slot = xp.asarray(rows[part, SLOT]) if part.any() else None
            # its kernels' own stream (on this device), behind what the caller queued (what
            # wrote the sources), so that the caller's later work (hashing, packing) does not
            # queue behind all of them
            self.stream = xp.cuda.Stream(non_blocking=True)
        self.parts_keys = np.concatenate([t.keys() for t in mine if t.part] or
                                         [np.zeros(0, np.int64)])
        self.launches = _cuts(rows[:, 0], dtypes, qz.step)
        self.parts_launches = _cuts(rows[part, 0], dtypes, max(len(rows), 1))
        # each output buffer's event is recorded after the last launch that writes it
        last: dict[str, int] = {}
        for k, (lo, hi, _) in enumerate(self.launches):
            for t in np.unique(rows[lo:hi, 0]).tolist():
                last[mine[t].weights] = last[mine[t].scales] = k
        self.done_after = [[n for n, k_ in last.items() if k_ == k]
                           for k in range(len(self.launches))]
        self._task_rows: tuple | None = None  # (source addresses, device table)

    def _task_table(self, qz: Quantiser, live) -> tuple[Any, list]:
        """The task rows (:data:`TASK` columns) for the ``live`` sources (C-contiguous, as wb
        checks its buffers), made again only when a source moved; and the sources, which the
        kernels read."""
        sources = {t.source: live[t.source][1] for t in (qz.tasks[i] for i in self.tasks)}
        addrs = tuple(int(sources[qz.tasks[i].source].data.ptr) for i in self.tasks)
        if self._task_rows is None or self._task_rows[0] != addrs:
            scaled = qz.q.scaled
            tbl = np.zeros((len(self.tasks), TASK), np.int64)
            for k, i in enumerate(self.tasks):
                t = qz.tasks[i]
                tbl[k] = (addrs[k], int(qz.buffers[t.weights].data.ptr),
                          int(qz.buffers[t.scales].data.ptr), int(scaled.rows[t.tensor]),
                          int(scaled.cols[t.tensor]), int(scaled.grid_cols[t.tensor]),
                          GIVEN if t.part else WHOLE, 0)
            self._task_rows = (addrs, self.xp.asarray(tbl))
        return self._task_rows[1], list(sources.values())

    def queue(self, qz: Quantiser, live, ready: dict | None) -> list:
        """Queues the launches on the current device: every row (``ready`` a dict: each output
        buffer's event goes there) or, ``ready`` None, only the parts' amax. Returns what the
        kernels read (to keep until they finished)."""
        xp, (bh, bw) = self.xp, self.block
        tasks, sources = self._task_table(qz, live)
        self.stream.wait_event(recorded(xp, xp.cuda.get_current_stream()))
        with self.stream:
            self._queue(tasks, ready, bh, bw)
        return [sources, tasks]

    def _queue(self, tasks, ready: dict | None, bh: int, bw: int) -> None:
        xp = self.xp
        rows, launches, mode = (self.rows, self.launches, -1) if ready is not None else \
            (self.parts, self.parts_launches, PARTS)
        for k, (lo, hi, dtype) in enumerate(launches):
            quant_kernel(dtype, self.fmt)((hi - lo,), (THREADS,), (
                rows[lo:hi], tasks, self.gather, self.amax, np.int64(hi - lo), np.int32(bh),
                np.int32(bw), np.int32(mode)))
            done = self.done_after[k] if ready is not None else ()
            if done:
                ev = recorded(xp, self.stream)
                for n in done:
                    ready[n] = ev


def _cuts(task_of: np.ndarray, dtypes: list[str], step: int) -> list[tuple[int, int, str]]:
    """``[(lo, hi, source dtype)]``: rows cut where the source dtype changes and every ``step``
    rows within each run of one dtype (``task_of``: each row's task, ``dtypes``: each task's)."""
    kind = np.array([dtypes[t] for t in task_of.tolist()], object)
    edges = np.flatnonzero(kind[1:] != kind[:-1]) + 1 if kind.size else np.zeros(0, int)
    cuts = []
    for lo, hi in zip([0, *edges.tolist()], [*edges.tolist(), kind.size]):
        cuts += [(a, min(a + step, hi), str(kind[lo])) for a in range(lo, hi, step)]
    return cuts


def block_table(tasks, bh: int, bw: int) -> tuple[np.ndarray, np.ndarray]:
    """Every block of ``tasks`` (:class:`wb.algorithms.fp8.tasks.Task`) as one row of
    :data:`ROW` int64 columns, task by task in the order given, and the positions of the
    blocks read element by element, concatenated (what the kernel's ``gather`` column points
    into).

    Returns:
        ``(rows, gather)``: ``rows`` ``(n, ROW)``: the task's index in ``tasks``, the block's
        index in its task (its scale's), its key (block index in the tensor's grid), its
        ``at`` (3), the offset of its positions in ``gather`` (-1: affine), its window (4)
        and its slot (the row's index: where parts' amax go).
    """
    rows, gather, base = [], [], 0
    for k, task in enumerate(tasks):
        blocks, at, g, odd, win = task.device_arrays(np, bh, bw)
        n = blocks.size
        r = np.empty((n, ROW), np.int64)
        r[:, 0], r[:, 1], r[:, 2], r[:, 3:6] = k, np.arange(n), blocks, at
        r[:, 6] = np.where(odd >= 0, base + odd * (bh * bw), -1)
        r[:, 7:11] = win
        rows.append(r)
        if g.size:
            gather.append(g.reshape(-1))
            base += g.size
    table = np.concatenate(rows) if rows else np.zeros((0, ROW), np.int64)
    table[:, SLOT] = np.arange(len(table))
    return table, (np.concatenate(gather) if gather else np.zeros(0, np.int64))


def amax_bytes(keys: np.ndarray, amax: np.ndarray) -> bytes:
    """``(keys, amax)`` of block parts (:func:`wb.algorithms.fp8.tasks.partial_amax`) as sealed
    bytes for the store (:mod:`wb.data.sealed`): their count, the int64 keys, the float64 amax
    (little-endian)."""
    return seal("FP8 amax exchange", np.int64(keys.size).astype("<i8").tobytes()
                + keys.astype("<i8").tobytes() + amax.astype("<f8").tobytes())


def amax_from_bytes(b: bytes, *, where: str = "an FP8 amax exchange") -> tuple[np.ndarray,
                                                                               np.ndarray]:
    """The inverse of :func:`amax_bytes`, once the digest matches.

    Raises:
        TransferError: the bytes changed since they were written, or hold no whole count of
            keys and amax; names ``where``.
    """
    p = unseal("FP8 amax exchange", b, where=where, remedy="the rendezvous store is corrupt")
    n = int(np.frombuffer(p, "<i8", 1)[0]) if len(p) >= 8 else -1
    if n < 0 or len(p) != 8 + 16 * n:
        raise TransferError(f"{where} holds {len(p)} bytes, not a count and as many int64 keys "
                            f"and float64 amax")
    return np.frombuffer(p, "<i8", n, 8), np.frombuffer(p, "<f8", n, 8 + 8 * n)
