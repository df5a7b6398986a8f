"""Successive weight versions as an RL trainer makes them: float32 master weights stepped by Adam
with seeded gradients, cast to the rollouts' dtype (bfloat16) per version. At the learning rates
of RL fine-tuning most cast values come out as they were one version before, which is what a
delta update (:mod:`wb.algorithms.delta`) saves.

Examples:
    >>> v = AdamVersions({"w": (256, 256)}, lr=1e-5, seed=0)
    >>> first, second = v.weights(), v.step()
    >>> 0.0 < changed_fraction(first, second) < 0.5
    True
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from wb.data.dtypes import dtype_info

__all__ = ["AdamVersions", "changed_fraction"]


class AdamVersions:
    """Master weights (float32, normal of ``init_std``) and Adam's moments, one optimizer step
    per version; :meth:`weights` casts the masters to ``dtype`` (round to nearest even).

    Args:
        shapes: ``{name: shape}`` of the tensors.
        lr: the learning rate (RL fine-tuning: 1e-6 to 1e-5).
        seed: seeds the initial weights and every step's gradients.
        grad_std: the gradients' scale (normal, a new draw per step; Adam's step hardly depends
            on it, its ratio to ``eps`` aside).
        dtype: what the rollouts hold (a dtype name of :mod:`wb.data.dtypes`).
        betas, eps: Adam's.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], *, lr: float, seed: int = 0,
                 init_std: float = 0.02, grad_std: float = 1e-3, dtype: str = "bfloat16",
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        if not lr > 0:
            raise ValueError(f"AdamVersions: lr={lr!r} must be positive")
        self.lr, self.grad_std, self.dtype = float(lr), float(grad_std), dtype
        self.betas, self.eps = betas, float(eps)
        self._rng = np.random.default_rng(seed)
        self.masters = {n: (self._rng.standard_normal(s) * init_std).astype(np.float32)
                        for n, s in shapes.items()}
        self._m = {n: np.zeros_like(a) for n, a in self.masters.items()}
        self._v = {n: np.zeros_like(a) for n, a in self.masters.items()}
        self.version = 0

    def weights(self) -> dict[str, np.ndarray]:
        """The current version's tensors in ``dtype``."""
        out_dtype = dtype_info(self.dtype).numpy
        return {n: a.astype(out_dtype) for n, a in self.masters.items()}

    def step(self) -> dict[str, np.ndarray]:
        """One Adam step on every master; returns the new version's tensors in ``dtype``."""
        self.version += 1
        b1, b2 = self.betas
        t = self.version
        for n, w in self.masters.items():
            g = (self._rng.standard_normal(w.shape) * self.grad_std).astype(np.float32)
            m, v = self._m[n], self._v[n]
            m *= b1
            m += (1 - b1) * g
            v *= b2
            v += (1 - b2) * g * g
            m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
            w -= (self.lr * m_hat / (np.sqrt(v_hat) + self.eps)).astype(np.float32)
        return self.weights()


def changed_fraction(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    """The fraction of elements whose bits differ between two versions (same names and shapes)."""
    diff = total = 0
    for n, x in a.items():
        y = b[n]
        w = x.dtype.itemsize
        diff += int(np.count_nonzero(x.reshape(-1).view(f"u{w}") != y.reshape(-1).view(f"u{w}")))
        total += x.size
    return diff / max(total, 1)
