"""The public API of DESIGN.md section 8 exists under its names."""

import wb


def test_design_section_8_names():
    for name in ("CheckpointSpec", "SourceMap", "probe", "ProbeError", "PlanError", "TransferError",
                 "Layout", "Worker", "BufferSpec", "Cluster", "plan", "Plan", "Traffic",
                 "lower_bound", "run_local", "simulate"):
        assert hasattr(wb, name), name
    assert callable(wb.plan) and callable(wb.simulate) and callable(wb.probe)
    assert set(wb.__all__) <= set(dir(wb))


def test_presets_reexport_the_layout_generators():
    import wb.layouts.presets as presets
    for name in ("deployment", "DEPLOYMENTS", "megatron_trainer", "fsdp_trainer", "jax_trainer",
                 "vllm_rollout"):
        assert getattr(presets, name) is not None
    assert "kimi-k2" in deployments.DEPLOYMENTS
