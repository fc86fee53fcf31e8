"""Lazy bindings of the NKI kernels the operators call on `neuron`.

Nothing here imports `nki`, `torch_neuronx` or `nkilib` at module import: they exist only in the
Neuron image (PyPI's packages of those names are empty placeholders). Kernels come from the NKI
library bundled with neuronx-cc (`nkilib`) where it has a suitable one, rather than our own:
- rope_hf (nkilib.core.embeddings.rope_hf): HF layout [B, H, S, D], forward *and* backward
  (backward=True rotates the other way), packed cos|sin cache — exactly torchtitan's CosSinRoPE.
- router_topk (nkilib.core.router_topk): router logits x @ w [T, E] plus top-k; we take its
  logits and indices (softmax/normalisation stay in PyTorch so autograd sees them).
- moe_cte (nkilib.core.moe_cte): blockwise expert MLP; forward only (its blockwise backward is
  experimental), so the experts operator uses the reference backward.
"""

from __future__ import annotations

import functools
import importlib


@functools.cache
def nki_unavailable_reason() -> str | None:
    """None when NKI kernels can run here (Neuron image), else why not, in one line."""
    for module in ("nki", "torch_neuronx", "nkilib"):
        try:
            importlib.import_module(module)
        except Exception as err:  # placeholders raise on import, not ImportError only
            return f"`import {module}` failed ({type(err).__name__}: {err})".splitlines()[0][:200]
    return None


def _wrap(kernel):
    from torch_neuronx import wrap_nki

    return wrap_nki(kernel)


@functools.cache
def rope_hf():
    from nkilib.core.embeddings.rope_hf import rope_hf as kernel

    return _wrap(kernel)


@functools.cache
def router_topk():
    from nkilib.core.router_topk.router_topk import router_topk as kernel

    return _wrap(kernel)


def lnc() -> int:
    import os

    return int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", "1"))
