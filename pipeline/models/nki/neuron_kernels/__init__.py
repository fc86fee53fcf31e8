"""The NKI entry points `torch_neuronx.wrap_nki` takes, one module per kernel; each module imports
only in the Neuron image (nki and nki-library's nkilib exist only there).

One import per kernel: a kernel whose module fails to import (a decorator NKI rejects, a function
nki-library moved) takes down only the override that launches it (pipeline.models.nki.kernels), never
another's: a failing MoE kernel leaves the dense model's RoPE running.

wrap_nki reads a jitted kernel's `.func` and signature (torch_neuronx nki_hop.py), so each entry is an
`nki.jit` kernel whose arguments are tensors or plain constants. Kernel code stays in nki-library; the
float32 references these are checked against live beside the callers (`ops.rope_reference`,
`ops.router_reference`, `layout.moe_cte_reference`). This package's own module imports everywhere.
"""

from __future__ import annotations


def plain_function(kernel):
    """The Python function under an nki-library kernel that is already `@nki.jit` (its `.func`, what
    wrap_nki itself reads), or the function itself when nki-library left it plain.

    An entry point that needs an nki-library kernel calls this inside its own single `@nki.jit`: NKI 0.7
    (Neuron 2.33) raises when a nested `@nki.jit` sub-kernel's config disagrees with the top-level
    kernel's unless that kernel's `SpecializationConfig.allow_nested_config_override` is set
    (awsdocs-neuron v2.33.1 nki/api/generated/nki.compiler.SpecializationConfig, nki.jit), and which
    config nki-library's 2.33 build gives its kernels is not in any source read here. With the plain
    function there is one jit, ours, and nothing nested to disagree with.
    """
    return getattr(kernel, "func", kernel)
