"""``python -m wb demo``: a JAX trainer feeding PyTorch rollouts (or the reverse) between
local processes over UCX, checked after every update."""
