"""The catalogue of real framework layouts: model configs and dimensions, Megatron, FSDP, JAX
and vLLM layout generators, and the paper-scale preset deployments built from them."""
