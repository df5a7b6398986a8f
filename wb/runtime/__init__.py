"""The runtime, in four rooms by concern, each importing only the rooms below it:

- :mod:`wb.runtime.endpoints`: what users hold: :class:`wb.Sender` and :class:`wb.Receiver` (one
  worker's end across versions), the groups a shim drives (:class:`wb.SenderGroup`,
  :class:`wb.ReceiverGroup`), :class:`wb.LocalSession`, the sync modes and the update records.
- :mod:`wb.runtime.membership`: who takes part in a version: the set-up meeting
  (:func:`wb.agree_parts`), heartbeats, versions that finish without the dead, joining.
- :mod:`wb.runtime.engine`: one rank's part of a plan run as one update: the program, the update
  loop, buffers and DLPack, casts, packing kernels and the FP8 quantiser.
- :mod:`wb.runtime.transport`: moving bytes between ranks (:class:`wb.Transport`, UCX, local
  threads) and the key -> bytes stores processes meet through.
"""
