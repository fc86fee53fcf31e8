"""Registry: training path → how its model spec is built. One entry per path."""

from __future__ import annotations

from collections.abc import Callable

from pipeline.qwen3_arch import Qwen3Arch
from pipeline.run_spec import RunSpec

MODEL_BUILDERS: dict[str, Callable[[RunSpec], object]] = {}


def register(path: str):
    def wrap(fn):
        MODEL_BUILDERS[path] = fn
        return fn

    return wrap


@register("native")
def _native(spec: RunSpec):
    from pipeline import native_model

    return native_model.model_spec(Qwen3Arch(**spec.arch), spec.model_name)


@register("nki")
def _nki(spec: RunSpec):
    # Same model as native: the NKI modules come in through override.imports (see
    # pipeline.nki.prepare), so parameter names and checkpoints stay native's.
    return _native(spec)


def build(spec: RunSpec):
    return MODEL_BUILDERS[spec.path](spec)


@register("hf")
def _hf(spec: RunSpec):
    import json
    from pathlib import Path

    from pipeline import hf_model

    return hf_model.model_spec(json.loads((Path(spec.hf_dir) / "config.json").read_text()), spec.model_name)
