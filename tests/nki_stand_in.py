"""A stand-in for the `nki` package (NKI 0.7, Neuron 2.33.1) that enforces the documented rules the
pipeline's entry points depend on, for tests on machines where the real package cannot be installed:

- the decorator's signature, `nki.jit(fn=None, *, compile_config=None, specialization_config=None,
  **kwargs)` (awsdocs-neuron v2.33.1 nki/api/generated/nki.jit): the configs are keyword-only;
- nesting: a `@nki.jit` kernel called while another kernel is being specialized is a nested sub-kernel;
  when its config disagrees with the top-level kernel's, specialization raises, unless the top-level
  kernel's `SpecializationConfig(allow_nested_config_override=True)` lets it inline under the top-level
  config with a warning (nki/api/generated/nki.compiler.SpecializationConfig);
- what torch_neuronx's wrap_nki reads of a kernel: `.func` and its signature (`.sign`, nki_hop.py), and
  a grid given as a tuple (`caller[(lnc,)]`; one public nki_hop.py does `tuple(map(int, grid))`).

A kernel launched through the stand-in's wrap_nki really is specialized: its function runs, and every
nested kernel it calls is checked against the rules above.
"""

from __future__ import annotations

import inspect
import types
import warnings
from dataclasses import dataclass


class NestedConfigError(RuntimeError):
    """What specialization raises for a nested kernel whose config disagrees with the top-level one."""


@dataclass(frozen=True)
class CompileConfig:
    address_rotation: object = None
    non_ssa_legalization: bool = False
    dead_code_elim: bool = False
    barrier_check: bool = False


@dataclass(frozen=True)
class SpecializationConfig:
    allow_nested_config_override: bool = False


_TRACING: list[Kernel] = []  # the kernels being specialized, the top-level one first


class Kernel:
    """What nki.jit returns, as far as wrap_nki and specialization use it."""

    def __init__(self, fn, compile_config, specialization_config, options):
        self.func, self.sign = fn, inspect.signature(fn)
        self.compile_config, self.specialization_config, self.options = compile_config, specialization_config, options

    @property
    def config(self) -> tuple:
        return self.compile_config, self.specialization_config, tuple(sorted(self.options.items()))

    def __call__(self, *args, **kwargs):
        if not _TRACING:  # the top-level kernel: specialize it
            _TRACING.append(self)
            try:
                return self.func(*args, **kwargs)
            finally:
                _TRACING.clear()
        top = _TRACING[0]
        if self.config != top.config:
            allowed = top.specialization_config is not None and top.specialization_config.allow_nested_config_override
            if not allowed:
                raise NestedConfigError(f"nested @nki.jit kernel {self.func.__name__} has config {self.config}, the "
                                        f"top-level kernel {top.func.__name__} has {top.config}")
            warnings.warn(f"{self.func.__name__} inlined under {top.func.__name__}'s config", stacklevel=2)
        return self.func(*args, **kwargs)

    def __getitem__(self, grid):
        return self


def jit(fn=None, *, compile_config=None, specialization_config=None, **kwargs):
    if fn is not None:
        return Kernel(fn, compile_config, specialization_config, kwargs)
    return lambda f: Kernel(f, compile_config, specialization_config, kwargs)


@dataclass
class Array:
    shape: tuple
    dtype: str
    buffer: str = "hbm"


def language(record: dict) -> types.SimpleNamespace:
    def ndarray(shape, dtype, buffer):
        array = Array(tuple(shape), dtype, buffer)
        record.setdefault("allocated", []).append(array)
        return array

    return types.SimpleNamespace(ndarray=ndarray, float32="float32", uint32="uint32", shared_hbm="shared_hbm")


def wrap_nki(record: dict):
    """torch_neuronx.wrap_nki as far as the pipeline uses it: reads .sign and .func (a plain function has
    neither), takes a tuple grid, and launching specializes the kernel."""
    def wrap(kernel):
        _sign, func = kernel.sign, kernel.func
        record.setdefault("wrapped", []).append(func.__name__)

        class Caller:
            def __getitem__(self, grid):
                record.setdefault("grids", []).append(tuple(map(int, grid)))
                return kernel[grid]
        return Caller()
    return wrap


def modules(record: dict) -> dict[str, object]:
    """sys.modules entries: nki (with nki.language and nki.compiler) and torch_neuronx's wrap_nki."""
    nl = language(record)
    compiler = types.SimpleNamespace(CompileConfig=CompileConfig, SpecializationConfig=SpecializationConfig)
    return {"nki": types.SimpleNamespace(jit=jit, language=nl, compiler=compiler), "nki.language": nl,
            "nki.compiler": compiler, "torch_neuronx": types.SimpleNamespace(wrap_nki=wrap_nki(record))}
