"""A trainer's quantisation before each update: its blocks of the declared tensors, gathered from
its live buffers, quantised into the buffers the plan sends (:mod:`wb.algorithms.blockplan`).

Host buffers use numpy (:func:`wb.algorithms.blockplan.quantize_buffers`). CUDA buffers use CuPy
on their device, by the rule of :mod:`wb.data.blockscale` computed in double (exact for every
value a block holds; a quotient of two floats rounded to double and then to float32 is the
float32 quotient): values decoded from their raw bits, ``amax`` and ``x / scale`` in double,
each rounded to float32 and then to the format by the kernels of :mod:`wb.runtime.casts`, which
use integer and double arithmetic only (no flush of subnormals to zero).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from wb.algorithms.blockplan import Quantized, quantize_buffers
from wb.data.blockscale import FORMATS
from wb.runtime.casts import assign, xp_dtype

__all__ = ["Quantiser"]


class Quantiser:
    """Trainer ``rank``'s quantisation: its output buffers (zeroed, each on the device and array
    module of the buffer its blocks are read from) and, on CUDA, its gather indices there.

    Args:
        q: from :func:`wb.algorithms.blockplan.quantize_layouts`.
        rank: the trainer's rank.
        live: ``{name: (xp, array)}`` of its buffers (:func:`wb.runtime.buffers.as_array`).
        chunk: elements quantised at once on a GPU (its temporaries: about 40 bytes each).

    Attributes:
        buffers: ``{name: array}`` to add to the trainer's buffers (what the plan sends).
    """

    def __init__(self, q: Quantized, rank: int, live: Mapping[str, tuple[Any, Any]], *,
                 chunk: int = 1 << 24):
        self.q, self.rank = q, rank
        bh, bw = q.scaled.decl.block
        self.step = max(1, chunk // (bh * bw))  # blocks quantised at once on a GPU
        self.tasks = q.tasks.get(rank, ())
        shapes = q.shapes(rank)
        self.buffers: dict[str, Any] = {}
        self._on: dict[int, tuple] = {}  # task index -> its blocks' arrays on its device
        for i, task in enumerate(self.tasks):
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
            if xp is not np:
                with xp.cuda.Device(src.device.id):
                    self._on[i] = task.device_arrays(xp)
        # the tasks whose buffers are on the host (numpy), decided once: devices do not change
        host = tuple(t for t in self.tasks if live[t.source][0] is np)
        self._host = Quantized(q.scaled, q.trainers, {rank: host}) if host else None

    def run(self, live: Mapping[str, tuple[Any, Any]]) -> None:
        """Fills :attr:`buffers` from the ``live`` buffers (as given at set-up, or new ones of the
        same shapes)."""
        if self._host is not None:
            host = self._host.tasks[self.rank]
            quantize_buffers(self._host, self.rank, {t.source: live[t.source][1] for t in host},
                             out={n: self.buffers[n] for t in host for n in (t.weights, t.scales)})
        for i, task in enumerate(self.tasks):
            xp, src = live[task.source]
            if xp is not np:
                with xp.cuda.Device(src.device.id):
                    for lo in range(0, task.blocks.size, self.step):
                        self._run_cuda(xp, task, self._on[i], src, lo, lo + self.step)

    def _run_cuda(self, cp, task, on, src, lo, hi) -> None:
        decl = self.q.scaled.decl
        src_dtype = self.q.scaled.trainer_spec.dtype(self.q.scaled.names[task.tensor])
        pos = task.positions(self.q.scaled, lo, hi, xp=cp, on=on)
        ok = pos >= 0
        raw = src.reshape(-1)[cp.maximum(pos, 0)]
        x32 = cp.empty(raw.shape, np.float32)  # float64 rounds to float32 first, as the rule
        assign(cp, x32, raw, "float32", src_dtype)
        x = cp.empty(raw.shape, np.float64)
        assign(cp, x, x32, "float64", "float32")
        x = cp.where(ok, x, 0.0)
        amax = cp.abs(x).max(axis=(1, 2)) if x.size else cp.zeros(x.shape[0], np.float64)
        amax = cp.where(cp.isnan(x).any(axis=(1, 2)), cp.nan, amax)  # as numpy's max: NaN wins
        s32 = cp.empty(amax.shape, np.float32)
        assign(cp, s32, amax / FORMATS[decl.format], "float32", "float64")
        s = cp.empty(amax.shape, np.float64)
        assign(cp, s, s32, "float64", "float32")
        s = s[:, None, None]
        y = cp.where(s == 0, 0.0, x / cp.where(s == 0, 1.0, s))
        y = cp.where(cp.isfinite(amax)[:, None, None], y, cp.nan)  # the rule: NaN blocks
        y32 = cp.empty(y.shape, np.float32)
        assign(cp, y32, y, "float32", "float64")
        q = cp.empty(y32.shape, self.buffers[task.weights].dtype)
        assign(cp, q, y32, decl.format, "float32")
        self.buffers[task.weights].reshape(-1)[pos[ok]] = q[ok]
        self.buffers[task.scales][lo:hi] = s32
