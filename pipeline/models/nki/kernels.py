"""Lazy bindings of the NKI kernels the operators call on `neuron`.

Nothing here imports `nki`, `torch_neuronx` or `nkilib` at module import: they exist only in the
Neuron image (PyPI's packages of those names are empty placeholders). The jitted entry points live
in `neuron_kernels` (imported on first use); each is wrapped once with torch_neuronx's `wrap_nki`
and launched with the grid as a tuple, `caller[(lnc,)]`: one public torch_neuronx/nki_hop.py does
`tuple(map(int, grid))`, so an int grid fails there while a tuple works with every version
(neuron.md, "The kernel grid").
"""

from __future__ import annotations

import functools
import importlib
import os

from pipeline.models.nki.constraints import TRN2_DEFAULT_LNC
from pipeline.run.targets import LNC_ENV


@functools.cache
def nki_unavailable_reason() -> str | None:
    """None when NKI kernels can run here (Neuron image), else why not, in one line."""
    for module in ("nki", "torch_neuronx", "nkilib"):
        try:
            importlib.import_module(module)
        except Exception as err:  # placeholders raise on import, not ImportError only
            return f"`import {module}` failed ({type(err).__name__}: {err})".splitlines()[0][:200]
    return None


def lnc() -> int:
    """The logical-core degree the kernels are launched with: NEURON_LOGICAL_NC_CONFIG, else trn2's
    runtime default (2)."""
    value = os.environ.get(LNC_ENV, str(TRN2_DEFAULT_LNC))
    if value not in ("1", "2"):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG={value!r}: trn2 runs LNC 1 or 2")
    return int(value)


@functools.cache
def _wrapped(name: str):
    from torch_neuronx import wrap_nki

    from pipeline.models.nki import neuron_kernels

    return wrap_nki(getattr(neuron_kernels, name))


def launch(name: str):
    """The wrap_nki caller of `neuron_kernels.<name>` on the current LNC grid."""
    return _wrapped(name)[(lnc(),)]
