"""Block-scaled FP8 rollouts, as algorithms over layouts: what each trainer buffer holds of the
declared tensors' blocks (:mod:`~wb.algorithms.fp8.held`) and who quantises which block, turning
trainer layouts into holders of the FP8 checkpoint (:mod:`~wb.algorithms.fp8.tasks`). The
declaration and the quantisation rule are data (:mod:`wb.data.fp8`); the quantiser that runs
before each push is the engine's (:mod:`wb.runtime.engine.fp8`)."""
