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


def build(spec: RunSpec):
    return MODEL_BUILDERS[spec.path](spec)
