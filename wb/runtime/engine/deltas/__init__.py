"""Deltas: a version sent as what changed since the version its receiver holds.

- :mod:`~wb.runtime.engine.deltas.units`: what a unit's delta is (the job's
  :class:`~wb.runtime.engine.deltas.units.DeltaPlan`, its encoding, how it lands, what
  forwards keep of it);
- :mod:`~wb.runtime.engine.deltas.batches`: a turn's sends encoded together and the receives a
  turn completed applied together, the host never waiting for a device;
- :mod:`~wb.runtime.engine.deltas.device`: the codec on one message where the buffers are;
- :mod:`~wb.runtime.engine.deltas.tables`: the codec over many messages at once, one launch per
  step from a table;
- :mod:`~wb.runtime.engine.deltas.kernels`: the CUDA source of the codec's kernels.

The host codec (the bytes) is :mod:`wb.algorithms.delta`.
"""
