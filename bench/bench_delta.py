"""Delta encoding of successive weight versions, the codec alone (no transfer): how much of a
version changes at RL learning rates, and what a delta of it costs against the dense bytes.

Versions come from :class:`wb.testing.versions.AdamVersions` (float32 masters, Adam steps with
seeded gradients, cast to bfloat16): ``--layers`` blocks of a transformer of ``--hidden`` (four
attention matrices and three MLP matrices of ``4 * hidden`` each). Per version and learning rate:
the fraction of elements changed, the delta's bytes against the dense bytes and against the
changed values' own bytes, the encoding each tensor took, and the time to encode and to apply
every tensor's delta (numpy, this host) beside a copy of the dense bytes. Every applied delta is
checked bit for bit against the new version.

    python bench/bench_delta.py [--lr 1e-6 1e-5] [--versions 4] [--hidden 1024 --layers 2] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import numpy as np

from wb.algorithms import delta
from wb.testing.versions import AdamVersions


def _shapes(hidden: int, layers: int) -> dict[str, tuple[int, int]]:
    out = {}
    for i in range(layers):
        for n in ("q", "k", "v", "o"):
            out[f"layers.{i}.attn.{n}"] = (hidden, hidden)
        out[f"layers.{i}.mlp.gate"] = (4 * hidden, hidden)
        out[f"layers.{i}.mlp.up"] = (4 * hidden, hidden)
        out[f"layers.{i}.mlp.down"] = (hidden, 4 * hidden)
    return out


def run(lr: float, versions: int, hidden: int, layers: int, seed: int) -> list[dict]:
    gen = AdamVersions(_shapes(hidden, layers), lr=lr, seed=seed)
    prev, rows = gen.weights(), []
    for v in range(1, versions + 1):
        new = gen.step()
        raw = {n: (prev[n].reshape(-1).view(np.uint8), new[n].reshape(-1).view(np.uint8))
               for n in new}
        t = time.perf_counter()
        deltas = {n: delta.encode(b, a, itemsize=2) for n, (b, a) in raw.items()}
        encode_s = time.perf_counter() - t
        targets = {n: b.copy() for n, (b, _) in raw.items()}
        t = time.perf_counter()
        for n, d in deltas.items():
            delta.apply(targets[n], d)
        apply_s = time.perf_counter() - t
        exact = all(np.array_equal(targets[n], a) for n, (_, a) in raw.items())
        t = time.perf_counter()
        for n, (_, a) in raw.items():
            targets[n][:] = a  # the dense copy a receiver makes
        copy_s = time.perf_counter() - t
        dense = sum(a.nbytes for _, a in raw.values())
        wire = sum(d.nbytes for d in deltas.values())
        changed = sum(delta.changed(b, a, itemsize=2).size for b, a in raw.values())
        rows.append({"lr": lr, "version": v, "changed_fraction": changed / (dense // 2),
                     "dense_bytes": dense, "delta_bytes": wire, "over_dense": wire / dense,
                     "over_changed_values": wire / max(2 * changed, 1),
                     "encodings": dict(collections.Counter(delta.kind_of(d)
                                                           for d in deltas.values())),
                     "encode_s": encode_s, "apply_s": apply_s, "dense_copy_s": copy_s,
                     "bit_identical": exact})
        prev = new
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--versions", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    rep = {"hidden": a.hidden, "layers": a.layers, "dtype": "bfloat16",
           "runs": [r for lr in a.lr for r in run(lr, a.versions, a.hidden, a.layers, a.seed)]}
    if a.out:
        Path(a.out).write_text(json.dumps(rep, indent=1))
    if a.json:
        print(json.dumps(rep))
        return
    print(f"{'lr':>7} {'v':>2} {'changed':>8} {'delta/dense':>11} {'delta/values':>12} "
          f"{'encode ms':>9} {'apply ms':>8} {'copy ms':>7}  encodings")
    for r in rep["runs"]:
        print(f"{r['lr']:>7.0e} {r['version']:>2} {r['changed_fraction']:>8.4f} "
              f"{r['over_dense']:>11.3f} {r['over_changed_values']:>12.2f} "
              f"{r['encode_s'] * 1e3:>9.1f} {r['apply_s'] * 1e3:>8.1f} "
              f"{r['dense_copy_s'] * 1e3:>7.1f}  {r['encodings']}"
              + ("" if r["bit_identical"] else "  NOT BIT-IDENTICAL"))


if __name__ == "__main__":
    main()
