"""The `nki` training path: torchtitan's Qwen3 with RoPE and the MoE router/experts replaced by
custom operators that run NKI kernels on `neuron` and their PyTorch reference elsewhere.

constraints: each kernel's documented shape rules.  kernels: lazy NKI bindings.
ops: the torch.library custom ops.  adapters: layout changes between torchtitan and kernels.
modules/overrides: the replacement modules and their torchtitan @override factories.
prepare: the launcher-side hook that picks overrides and checks constraints.
"""
