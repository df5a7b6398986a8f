"""Test helpers users can import: brute-force oracles, successive weight versions as trainers
make them, and (with hypothesis) strategies."""

from wb.testing.oracle import correspondence_pairs, overlap_pairs
from wb.testing.versions import (SPARSE_EVERY, AdamById, AdamVersions, changed_fraction,
                                 sparse_step)

__all__ = ["correspondence_pairs", "overlap_pairs", "AdamVersions", "AdamById",
           "changed_fraction", "sparse_step", "SPARSE_EVERY"]
