"""Lazy bindings of the NKI kernels the operators call on `neuron`.

Nothing here imports `nki`, `torch_neuronx` or `nkilib` at module import: they exist only in the
Neuron image (PyPI's packages of those names are empty placeholders). The jitted entry points live
in `neuron_kernels`, one module per kernel (ENTRY_MODULES), each imported on its kernel's first use,
so a kernel that cannot be imported stops only the override launching it; each is wrapped once with
torch_neuronx's `wrap_nki` and launched with the grid as a tuple, `caller[(lnc,)]`: one public
torch_neuronx/nki_hop.py does `tuple(map(int, grid))`, so an int grid fails there while a tuple works
with every version.
"""

from __future__ import annotations

import functools
import importlib
import os

from pipeline.errors import PipelineError
from pipeline.models.nki.constraints import TRN2_DEFAULT_LNC
from pipeline.run.targets import LNC_ENV

# kernel entry point → its module in pipeline.models.nki.neuron_kernels (one import per kernel)
ENTRY_MODULES = {"rope_hf": "rope", "router_topk_kernel": "router", "moe_cte_shard_on_i": "moe"}


class KernelUnavailable(PipelineError):
    """One kernel's module did not import; the other kernels are not affected."""


@functools.cache
def nki_unavailable_reason() -> str | None:
    """None when NKI kernels can run here (Neuron image), else why not, in one line."""
    for module in ("nki", "torch_neuronx", "nkilib"):
        try:
            importlib.import_module(module)
        except Exception as err:  # noqa: BLE001 - placeholders raise on import, not ImportError only
            return f"`import {module}` failed ({type(err).__name__}: {err})".splitlines()[0][:200]
    return None


def lnc() -> int:
    """The logical-core degree the kernels are launched with: NEURON_LOGICAL_NC_CONFIG, else trn2's
    runtime default (2)."""
    value = os.environ.get(LNC_ENV, str(TRN2_DEFAULT_LNC))
    if value not in ("1", "2"):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG={value!r}: trn2 runs LNC 1 or 2")
    return int(value)


def entry(name: str):
    """The jitted entry point `name`, importing its own module only."""
    module = f"pipeline.models.nki.neuron_kernels.{ENTRY_MODULES[name]}"
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as err:  # a rejected decorator raises what NKI raises, not ImportError only
        cause = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        raise KernelUnavailable(f"NKI kernel {name} cannot be loaded ({module}: {cause}); the other kernels "
                                "are not affected.",
                                "leave its group out of nki_overrides (e.g. nki_overrides = [\"rope\"] without \"moe\"), "
                                "or fix its entry point against the installed nki / nki-library.") from err


@functools.cache
def _wrapped(name: str):
    from torch_neuronx import wrap_nki

    return wrap_nki(entry(name))


def launch(name: str):
    """The wrap_nki caller of `neuron_kernels.<name>` on the current LNC grid."""
    return _wrapped(name)[(lnc(),)]
