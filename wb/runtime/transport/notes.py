"""The control messages of the one-sided channel (:mod:`~wb.runtime.transport.ipc`): a batch
of rows, each a note of a send (where its bytes are) or an acknowledgement of a receive, then
the memory handles the notes name, each once.

A message is a header ``(rows, handles)``, the rows (:data:`ROW`: tag, bytes, offset into the
handle's memory, index of the handle, kind) and the handles, :data:`HANDLE_BYTES` each.
"""

from __future__ import annotations

import struct

import numpy as np

from wb.runtime.transport.memory import HANDLE_BYTES

__all__ = ["ROW", "HEADER", "NOTE_IPC", "NOTE_UCX", "ACK_OK", "ACK_NACK", "ACK_SIZE", "encode",
           "decode", "size"]

ROW = np.dtype([("tag", "<u8"), ("nbytes", "<u8"), ("offset", "<u8"), ("handle", "<u4"),
                ("kind", "<u4")])
HEADER = struct.Struct("<II")  # rows, handles
NOTE_IPC, NOTE_UCX, ACK_OK, ACK_NACK, ACK_SIZE = 1, 2, 3, 4, 5


def size(rows: int, handles: int) -> int:
    """Bytes of a message of ``rows`` rows and ``handles`` handles."""
    return HEADER.size + rows * ROW.itemsize + handles * HANDLE_BYTES


def encode(batch: list, handles: dict) -> np.ndarray:
    """The message of ``batch`` (rows as :data:`ROW` tuples) and ``handles`` (``{handle:
    index}``)."""
    arr = np.array(batch, ROW)
    msg = np.empty(size(len(batch), len(handles)), np.uint8)
    HEADER.pack_into(msg, 0, len(batch), len(handles))
    msg[HEADER.size:HEADER.size + arr.nbytes] = np.frombuffer(arr, np.uint8)  # no view checks
    at = HEADER.size + arr.nbytes
    for handle, k in handles.items():
        at_k = at + k * HANDLE_BYTES
        msg[at_k:at_k + HANDLE_BYTES] = np.frombuffer(handle, np.uint8)
    return msg


def decode(buf: np.ndarray) -> tuple[list, list[bytes]]:
    """A message's rows (tuples) and handles."""
    nrows, nhandles = HEADER.unpack_from(buf)
    at = HEADER.size
    rows = np.frombuffer(buf, ROW, nrows, at)
    at += nrows * ROW.itemsize
    handles = [bytes(buf[at + k * HANDLE_BYTES:at + (k + 1) * HANDLE_BYTES])
               for k in range(nhandles)]
    return rows.tolist(), handles
