"""Test helpers users can import: brute-force oracles and (with hypothesis) strategies."""

from wb.testing.oracle import correspondence_pairs, overlap_pairs

__all__ = ["correspondence_pairs", "overlap_pairs"]
