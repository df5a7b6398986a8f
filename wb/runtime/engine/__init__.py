"""One rank's part of a plan run as one update: the program worked out once per part
(:mod:`~wb.runtime.engine.program`), the loop that posts, completes and forwards its messages
(:mod:`~wb.runtime.engine.update`) with what it keeps in flight
(:mod:`~wb.runtime.engine.inflight`), and the one-shot entry points
(:mod:`~wb.runtime.engine.executor`); the buffers it reads and writes
(:mod:`~wb.runtime.engine.buffers`, :mod:`~wb.runtime.engine.dlpack`); and the device work of a
message: float conversions (:mod:`~wb.runtime.engine.casts`), packing kernels
(:mod:`~wb.runtime.engine.gather`) and the block-scaled FP8 quantiser
(:mod:`~wb.runtime.engine.fp8`)."""
