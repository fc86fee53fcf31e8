"""The training paths (`registry`) and their models: torchtitan's native Qwen3, Transformers' own
Qwen3 (`hf`), native with NKI kernels (`nki/`), and the CPU-only overrides."""
