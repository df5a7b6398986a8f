"""PyTorch shim of WeightBridge (probe, Sender) and the reference rollout model in `wb_torch.testing`."""
