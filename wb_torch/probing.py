"""The probe's per-element work on the parameters' device, with torch (mirrors
:mod:`wb_jax.probing`).

:class:`DeviceArrays` is a :class:`wb.algorithms.probing.ProbeArrays`: checkpoint tensors are made
on the device from per-base tables and row indices computed there (no host array per tensor, so
a pass is a stream of kernel launches the host never waits for); every buffer is checked there,
and a pass waits once, for all its checks; after the last pass ids are decoded there a chunk of
rows at a time, their runs are found there (:func:`wb.data.sourcemap.run_marks`, on the
device), and only the runs (O(runs)) come back for :meth:`wb.SourceMap.from_runs`.

Extra device memory (:data:`KEPT_BYTES`, :data:`TRANSIENT_BYTES`): per element of the probed
tensors, 1 byte (the written mask) plus one digit per pass (1 byte at base <= 256, 2 at <=
2**15, 4 above), kept across passes; while a tensor is read, at most :data:`TRANSIENT_BYTES`
more per element of that tensor, and while ids are decoded the same per element of one chunk
(``chunk`` elements, whole rows); plus the checkpoint tensors ``load_weights`` holds at once.
"""

from __future__ import annotations

import torch

import wb
from wb.algorithms.probing import Bad, RunMarks, Runs, chunks, idcode, runs_from_marks
from wb.data.dtypes import known_dtype

__all__ = ["DeviceArrays", "TRANSIENT_BYTES", "run_marks", "check_digit"]

#: Bound on the transient device bytes per element of the tensor being read, or of the chunk
#: being decoded (int64 ids, their differences, the check digits and a few masks);
#: ``tests/test_probe_torch.py`` measures it on a GPU.
TRANSIENT_BYTES = 48

_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# the contract's row multiplier as the int64 of the same bits: torch's int64 products wrap as
# the core's uint64 ones do
_ROW_MUL_INT64 = (idcode.ROW_MUL + 2**63) % 2**64 - 2**63


class DeviceArrays:
    """:class:`wb.algorithms.probing.ProbeArrays` with torch on ``device`` (the module docstring
    says what runs where and the memory it takes).

    Args:
        device: where the parameters live (a CPU works too, for tests).
        chunk: elements of a buffer decoded at once (whole rows).
    """

    def __init__(self, device: torch.device | str, chunk: int = 1 << 24):
        self.device = torch.device(device)
        self.chunk = int(chunk)
        self._tables: dict[tuple, torch.Tensor] = {}

    # --- feeding --------------------------------------------------------------------------------
    def _values(self, base: int, dtype: torch.dtype) -> torch.Tensor:
        """``(base,)`` raw bits of ``digit + 1`` in ``dtype``."""
        key = ("values", base, dtype)
        if key not in self._tables:
            v = torch.arange(1, base + 1, dtype=torch.float32, device=self.device).to(dtype)
            self._tables[key] = v.view(_RAW[v.element_size()])
        return self._tables[key]

    def _check(self, base: int, dtype: torch.dtype) -> torch.Tensor:
        """``(base, base)`` raw bits of the check pass's values (:func:`idcode.check_table`)."""
        key = ("check", base, dtype)
        if key not in self._tables:
            idx = torch.from_numpy(idcode.check_table(base)).to(self.device)
            self._tables[key] = self._values(base, dtype)[idx]
        return self._tables[key]

    def feed(self, spec, name, base, pass_index):
        dtype = getattr(torch, spec.dtype(name))
        out = torch.empty(spec.shape(name), dtype=dtype, device=self.device)
        first, n = spec.offset(name), out.numel()
        if n == 0:
            return out
        if base > idcode.TABLE_MAX:  # wide bases (float32): chunked arithmetic on the device
            for a in range(0, n, 1 << 22):
                ids = torch.arange(first + a, first + min(n, a + (1 << 22)), device=self.device)
                digit = _pass_digits(ids, pass_index, base) + 1
                out.view(-1)[a:a + ids.numel()] = digit.to(
                    torch.float32 if base <= 2**24 else torch.float64)
            return out
        # ids are rows of `base` ids: a partial first row, full rows, a partial last row
        flat = out.view(-1).view(_RAW[out.element_size()])
        row0, col0 = divmod(first, base)
        head = min(n, (base - col0) % base)
        full = (n - head) // base
        first_full = row0 + (head > 0)
        tail = n - head - full * base
        self._rows(flat[:head].view(1, head), pass_index, row0, col0, base, dtype)
        self._rows(flat[head:head + full * base].view(full, base), pass_index, first_full, 0, base,
                   dtype)
        self._rows(flat[n - tail:].view(1, tail), pass_index, first_full + full, 0, base, dtype)
        return out

    def _rows(self, out2d: torch.Tensor, k: int | None, row0: int, col0: int, base: int,
              dtype: torch.dtype) -> None:
        """Fills ``m`` rows of ids (row ``row0 ..``, columns ``col0 ..``) with pass ``k``'s
        values: pass 0 repeats one table row; pass ``k >= 1`` is one value per row; the check
        pass gathers rows of the check table. Row indices are computed on the device."""
        m, w = out2d.shape
        if m == 0 or w == 0:
            return
        values = self._values(base, dtype)
        if k == 0:
            out2d.copy_(values[col0:col0 + w].expand(m, w))
            return
        if m == 1:  # a partial row: its index is a Python int
            i = int(idcode.row_index(k, row0, 1, base)[0])
            out2d.copy_(values[i:i + 1].expand(1, w) if k is not None
                        else self._check(base, dtype)[i:i + 1, col0:col0 + w])
            return
        idx = _row_index(torch.arange(row0, row0 + m, device=self.device), k, base)
        if k is not None:
            out2d.copy_(values[idx].unsqueeze(1).expand(m, w))
        else:  # only full rows get here
            torch.index_select(self._check(base, dtype), 0, idx, out=out2d)

    # --- reading --------------------------------------------------------------------------------
    def buffer(self, name, arr):
        if not isinstance(arr, torch.Tensor):
            raise wb.ProbeError(f"`{name}` is a {type(arr).__name__}, not a tensor")
        return arr.detach()

    def dtype_name(self, a):
        return known_dtype(a.dtype)

    @staticmethod
    def _digit_mask(flat: torch.Tensor, base: int) -> torch.Tensor:
        if flat.is_floating_point():
            return (flat >= 0) & (flat <= base) & (flat == torch.round(flat))  # NaN fails all
        return (flat >= 0) & (flat <= base)

    @staticmethod
    def _flat(a: torch.Tensor) -> torch.Tensor:
        flat = a.reshape(-1)
        if flat.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            flat = flat.to(torch.float16)  # exact; few kernels take float8 operands
        return flat

    def read(self, a, base):
        flat = self._flat(a)
        ok = self._digit_mask(flat, base).all()
        d = flat.to(torch.int32)
        digit_dtype = torch.uint8 if base <= 256 else torch.int16 if base <= 2**15 else torch.int32
        return d != 0, (d - 1).to(digit_dtype), ok

    def first_bad(self, a, base):
        flat = self._flat(a)
        i = int((~self._digit_mask(flat, base)).nonzero()[0, 0])
        return Bad(i, f"reads {float(flat[i])}, not an integer digit 0..{base}")

    def same(self, a, b):
        return (a == b).all()

    def first_difference(self, a, b):
        return int((a != b).nonzero()[0, 0])

    def all_true(self, oks):
        if not all(bool(o) for o in oks if not isinstance(o, torch.Tensor)):
            return False
        dev = [o.reshape(()) for o in oks if isinstance(o, torch.Tensor)]
        return bool(torch.stack(dev).all()) if dev else True

    # --- decoding -------------------------------------------------------------------------------
    def runs(self, written, digits, base, numel, cols):
        *id_digits, check = digits
        parts = []
        for lo, hi in chunks(written.numel(), cols, self.chunk):
            w = written[lo:hi]
            ids = torch.zeros(hi - lo, dtype=torch.int64, device=self.device)
            scale = 1
            for d in id_digits:
                ids.add_(d[lo:hi].to(torch.int64), alpha=scale)
                scale *= base
            ids.masked_fill_(~w, 0)  # unwritten elements hold no digits
            over = ids >= numel
            wrong = w & (check[lo:hi] != check_digit(ids, base))
            flags = torch.stack([over.any(), wrong.any()]).tolist()
            if flags[0]:
                i = int(over.nonzero()[0, 0])
                return None, Bad(lo + i, f"decodes to id {int(ids[i])} >= numel "
                                                    f"{numel}"), False
            if flags[1]:
                i = int(wrong.nonzero()[0, 0])
                return None, Bad(
                    lo + i, "disagrees between the id passes and the check pass"), True
            del over, wrong
            ids.masked_fill_(~w, -1)
            parts.append(runs_from_marks(run_marks(ids, cols), hi - lo, cols, lo // cols))
        return Runs.concat(parts), None, False


def run_marks(v: torch.Tensor, cols: int) -> RunMarks:
    """:func:`wb.data.sourcemap.run_marks` of flat int64 ids on their device: only the marks
    (O(runs)) come to the host."""
    n = v.numel()
    valid = v != -1
    forced = valid.clone()
    forced[1:] &= ~valid[:-1]
    forced.view(-1, cols)[:, 0] = valid.view(-1, cols)[:, 0]
    cand = forced.clone()
    if n > 2:
        dd = v[2:] - v[1:-1]  # the second difference, in place: wraps like the core's
        dd.sub_(v[1:-1]).add_(v[:-2])
        cand[2:] |= valid[2:] & ~forced[1:-1] & (dd != 0)
        del dd
    last = valid.clone()
    last[:-1] &= ~valid[1:] | forced[1:]
    pos = cand.nonzero().squeeze(1)
    packed = torch.stack([pos, forced[pos].to(torch.int64), v[pos],
                          v[(pos + 1).clamp_(max=n - 1)]]).cpu().numpy()
    return RunMarks(packed[0], packed[1].astype(bool), packed[2], packed[3],
                    last.nonzero().squeeze(1).cpu().numpy())


def _row_index(rows: torch.Tensor, k: int | None, base: int) -> torch.Tensor:
    """:func:`wb.algorithms.probing.idcode.row_index` of int64 ``rows`` on their device."""
    if base & (base - 1):  # not a power of two (a base given by hand): on the host
        r0 = int(rows[0])
        idx = idcode.row_index(k, r0, rows.numel(), base)
        return torch.from_numpy(idx).to(rows.device)
    bits, mask = base.bit_length() - 1, base - 1
    if k is None:  # idcode.row_hash; see check_digit for the wrapping arithmetic
        return rows.mul_(_ROW_MUL_INT64).bitwise_right_shift_(idcode.ROW_SHIFT).bitwise_and_(mask)
    return rows.bitwise_right_shift_(bits * (k - 1)).bitwise_and_(mask)


def check_digit(ids: torch.Tensor, base: int) -> torch.Tensor:
    """:func:`wb.algorithms.probing.idcode.check_digit` on the device (int64 ids >= 0)."""
    if base & (base - 1):  # not a power of two (a base given by hand): on the host
        return torch.from_numpy(idcode.check_digit(ids.cpu().numpy(), base)).to(ids.device)
    shift, mask = base.bit_length() - 1, base - 1
    # int64 products wrap like the core's uint64 ones; the arithmetic shift differs from the
    # logical one only in bits the mask drops (the sign lands from bit 64 - ROW_SHIFT up, above
    # the log2(base) <= 24 bits the mask keeps)
    h = ids >> shift  # in place from here: 2 int64 temporaries per element, not 7
    h.mul_(_ROW_MUL_INT64).bitwise_right_shift_(idcode.ROW_SHIFT).bitwise_and_(mask)
    col = (ids & mask).mul_(idcode.COL_MUL % base)
    return h.add_(col).bitwise_and_(mask)


def _pass_digits(ids: torch.Tensor, pass_index: int | None, base: int) -> torch.Tensor:
    if pass_index is None:
        return check_digit(ids, base)
    return ids // base ** pass_index % base
