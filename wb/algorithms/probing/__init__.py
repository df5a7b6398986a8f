"""Probing a load function, and the surface a device implementation of its per-element work uses.

- :mod:`~wb.algorithms.probing.idcode`: the id encoding, the values every pass feeds and expects
  (the contract a device implementation follows exactly);
- :mod:`~wb.algorithms.probing.seam`: :class:`ProbeArrays`, the Protocol such an implementation
  fills in, with :class:`Bad`, :func:`chunks` and its memory bounds;
- :mod:`~wb.algorithms.probing.host`: :class:`HostArrays`, the numpy implementation;
- :mod:`~wb.algorithms.probing.run`: :func:`probe` (``wb.probe``), its pass loop and map cache.

What :meth:`ProbeArrays.runs` returns is built with :class:`Runs`, :class:`RunMarks`,
:func:`run_marks` and :func:`runs_from_marks` (from :mod:`wb.data.sourcemap`), re-exported here.
"""

from wb.algorithms.probing import idcode
from wb.algorithms.probing.host import HostArrays
from wb.algorithms.probing.run import ProbeCheckpoint, probe
from wb.algorithms.probing.seam import (DECODE_CHUNK, TRANSIENT_BYTES_PER_ELEMENT, Bad, ProbeArrays,
                                        chunks)
from wb.data.sourcemap import RunMarks, Runs, run_marks, runs_from_marks

__all__ = ["probe", "ProbeArrays", "HostArrays", "Bad", "ProbeCheckpoint", "chunks",
           "DECODE_CHUNK", "TRANSIENT_BYTES_PER_ELEMENT", "idcode", "Runs", "RunMarks",
           "runs_from_marks", "run_marks"]
