"""``python -m wb bench``: wb against the broadcast and naive-P2P baselines, measured side by
side between local processes (baselines, emulated links, the benchmark's worker processes)."""
