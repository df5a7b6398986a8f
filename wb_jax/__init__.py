"""JAX shim of WeightBridge: probe a JAX trainer's load function and send its sharded params."""
