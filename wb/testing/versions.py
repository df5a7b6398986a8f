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

__all__ = ["AdamVersions", "AdamById", "changed_fraction", "sparse_step", "SPARSE_EVERY"]

#: :func:`sparse_step` changes about one element in this many.
SPARSE_EVERY = 32


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
        t = self.version
        for n, w in self.masters.items():
            g = (self._rng.standard_normal(w.shape) * self.grad_std).astype(np.float32)
            _adam(w, self._m[n], self._v[n], g, t, self.lr, self.betas, self.eps)
        return self.weights()


def _adam(w, m, v, g, t: int, lr: float, betas, eps: float) -> None:
    """One Adam step of masters ``w`` (moments ``m``, ``v``) with gradient ``g``, in place."""
    b1, b2 = betas
    m *= b1
    m += (1 - b1) * g
    v *= b2
    v += (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
    w -= (lr * m_hat / (np.sqrt(v_hat) + eps)).astype(np.float32)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: uint64 in, well-mixed uint64 out (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _normals(ids: np.ndarray, key: int) -> np.ndarray:
    """One standard normal per id (float64), a function of the id and ``key`` alone."""
    a = _mix(ids.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(key))
    b = _mix(a ^ np.uint64(0xD6E8FEB86659FD93))
    u1 = ((a >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0 ** 53
    u2 = (b >> np.uint64(11)).astype(np.float64) / 2.0 ** 53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


class AdamById:
    """:class:`AdamVersions` for one worker's share of a model: the masters of the elements whose
    global ids it holds (``ids``, any shape; ``-1`` marks padding, kept 0), their initial values
    and every step's gradients drawn by hashing ``(seed, id, step)``. Every worker that holds an
    id computes the same values for it, so trainers sharded any way make one model, and a
    rollout can compute what it must hold. Memory: 17 bytes per element held (its id, master and
    moments), worked on in chunks of :data:`CHUNK`.

    Examples:
        >>> ids = np.arange(4096)
        >>> a, b = AdamById(ids, lr=1e-5), AdamById(ids[::-1].copy(), lr=1e-5)
        >>> a.step(); b.step()
        >>> bool((a.weights() == b.weights()[::-1]).all())
        True
        >>> 0.0 < changed_fraction({"w": AdamById(ids, lr=1e-5).weights()}, {"w": a.weights()}) < 1
        True
    """

    def __init__(self, ids, *, lr: float, seed: int = 0, init_std: float = 0.02,
                 grad_std: float = 1e-3, dtype: str = "bfloat16",
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        if not lr > 0:
            raise ValueError(f"AdamById: lr={lr!r} must be positive")
        ids = np.asarray(ids)
        self.shape, self.lr, self.seed, self.grad_std = ids.shape, float(lr), int(seed), grad_std
        self.dtype, self.betas, self.eps = dtype, betas, float(eps)
        self._mapped = ids.reshape(-1) >= 0
        held = ids.reshape(-1)[self._mapped]
        self._ids = held.astype(np.int32 if held.size and held.max() < 2**31 else np.int64)
        key = int(_mix(np.uint64([self.seed]))[0] & 0xFFFFFFFF)
        self.masters = np.empty(self._ids.size, np.float32)
        for s in _chunks(self._ids.size):
            self.masters[s] = _normals(self._ids[s], key) * init_std
        self._m = np.zeros_like(self.masters)
        self._v = np.zeros_like(self.masters)
        self.version = 0

    def weights(self) -> np.ndarray:
        """The current version, in ``dtype``, shaped as ``ids`` (padding 0)."""
        out = np.zeros(self._mapped.size, dtype_info(self.dtype).numpy)
        out[self._mapped] = self.masters.astype(out.dtype)
        return out.reshape(self.shape)

    def step(self) -> None:
        """One Adam step of every master (see :meth:`weights` for the new version)."""
        self.version += 1
        key = int(_mix(np.uint64([(self.seed << 20) + self.version]))[0])
        for s in _chunks(self._ids.size):
            g = (_normals(self._ids[s], key) * self.grad_std).astype(np.float32)
            _adam(self.masters[s], self._m[s], self._v[s], g, self.version, self.lr, self.betas,
                  self.eps)


#: Elements :class:`AdamById` works on at once (its temporaries: ~40 bytes each).
CHUNK = 1 << 20


def _chunks(n: int):
    return (slice(a, min(a + CHUNK, n)) for a in range(0, n, CHUNK))


def changed_fraction(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    """The fraction of elements whose bits differ between two versions (same names and shapes)."""
    diff = total = 0
    for n, x in a.items():
        y = b[n]
        w = x.dtype.itemsize
        diff += int(np.count_nonzero(x.reshape(-1).view(f"u{w}") != y.reshape(-1).view(f"u{w}")))
        total += x.size
    return diff / max(total, 1)


def sparse_step(a: np.ndarray, step: int) -> np.ndarray:
    """Training step ``step`` of ``python -m wb demo --delta``: ``w <- -2 w`` (exact) for the
    elements whose bits ``b`` (a signed integer of the element's width) have
    ``(b ^ (b >> 7)) & 31 == step & 31``, about one in :data:`SPARSE_EVERY`; the others keep
    theirs. A function of each element's bits alone, so any sharding of the weights steps alike
    (the trainers' frameworks do the same with their own operations).

    Examples:
        >>> a = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
        >>> 60 < int((sparse_step(a, 1) != a).sum()) < 200
        True
    """
    b = a.view(f"i{a.itemsize}")
    pick = ((b ^ (b >> 7)) & (SPARSE_EVERY - 1)) == (step & (SPARSE_EVERY - 1))
    return np.where(pick, a * np.asarray(-2.0, a.dtype), a).astype(a.dtype)

