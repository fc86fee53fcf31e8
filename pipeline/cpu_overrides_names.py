"""Names of the CPU-only overrides, importable without torch (for dry runs)."""

CPU_OVERRIDES = ["pipeline.cpu_overrides.dense_mask_attention", "pipeline.cpu_overrides.loop_experts"]
