"""How the pipeline describes a model to torchtitan: the one place that builds torchtitan's model spec,
the trainer config's model field and a model config's context length, from what the installed
torchtitan declares (its dataclass fields), never from its version.

The APIs this meets (docs/torchtitan-apis.md gives each source):
- 0.3.0 and upstream main of 2026-08-21: `Trainer.Config.model_spec` holds a `ModelSpec` (name, flavor,
  model, parallelize_fn, pipelining_fn, post_optimizer_build_fn, state_dict_adapter); the trainer resizes
  every RoPE cache to the training length in `update_from_config`.
- main after #4328 (~2026-08-26): `ModelSpec.max_context_length` is required, and the trainer no longer
  resizes RoPE caches: a cache is as long as the model config says.
- main after #4810 (~2026-09-21): no `ModelSpec`; `Trainer.Config.model` holds the model config, whose
  class owns its state-dict adapter (`state_dict_adapter_cls`), optimizer hooks and parallelization;
  decoder configs declare `max_context_length`.

Every path builds a ModelDescription sized for the run (`max_context_length` = its seq_len: RoPE caches
are built that long on every API, which the trainer no longer shrinks after #4328); `trainer_fields`
turns it into what the installed Trainer.Config takes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.errors import PipelineError

PORT_FIX = "port pipeline/titan/model_spec.py to it (docs/torchtitan-apis.md lists what each torchtitan API asks for)."


@dataclass(frozen=True)
class ModelDescription:
    """What the pipeline says about a model, whichever torchtitan API receives it."""

    name: str  # torchtitan's model name ("qwen3"; the hf path's "hf_qwen3")
    flavor: str  # the run's model key
    model: Any  # the model's BaseModel.Config
    max_context_length: int  # the run's seq_len: its RoPE caches are this long, and torchtitan is told so (#4328)
    parallelize_fn: Callable | None  # None where the model class parallelizes itself (after #4810)
    pipelining_fn: Callable | None = None
    post_optimizer_build_fn: Callable | None = None
    state_dict_adapter: type | None = None

    def with_model(self, model) -> ModelDescription:
        return dataclasses.replace(self, model=model)

    def adapter(self, hf_assets_path: str | None = None):
        """The path's state-dict adapter for its model (what export maps the HF save's keys back with)."""
        return self.state_dict_adapter(self.model, hf_assets_path)


def declared_fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def declares(cls, name: str) -> bool:
    return name in declared_fields(cls)


def required_fields(cls) -> list[str]:
    return [name for name, f in declared_fields(cls).items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def context_kwargs(config_cls, max_context_length: int) -> dict[str, int]:
    """`max_context_length=` for a model config class that declares it (decoder configs after #4810), else nothing."""
    return {"max_context_length": max_context_length} if declares(config_cls, "max_context_length") else {}


def rope_length_field(rope_config_cls) -> str:
    """The RoPE config's cache length: `max_seq_len` (0.3.0) or `max_context_length` (main, #4121)."""
    for name in ("max_context_length", "max_seq_len"):
        if declares(rope_config_cls, name):
            return name
    raise PipelineError(f"torchtitan's {rope_config_cls.__qualname__} declares neither max_context_length nor "
                        f"max_seq_len (it has: {', '.join(declared_fields(rope_config_cls))}).", PORT_FIX)


def rope_config(rope_cls, *, dim: int, max_len: int, theta: float, **extra):
    """A RoPE config whose cache covers `max_len` positions, under the name the installed RoPE.Config gives it."""
    return rope_cls.Config(dim=dim, theta=theta, **{rope_length_field(rope_cls.Config): max_len}, **extra)


def optional_name(module: str, name: str):
    """`module.name`, or None where this torchtitan has no such name (one an API after #4810 dropped)."""
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _model_spec_class():
    try:
        from torchtitan.protocols.model_spec import ModelSpec
    except ImportError:
        return None  # removed by #4810
    return ModelSpec


def _trainer_config_class():
    from torchtitan.trainer import Trainer

    return Trainer.Config


def model_field(trainer_config_cls=None) -> str:
    """The Trainer.Config field that holds the model: `model_spec` (a ModelSpec) or `model` (after #4810)."""
    cls = trainer_config_cls or _trainer_config_class()
    for name in ("model_spec", "model"):
        if declares(cls, name):
            return name
    raise PipelineError(f"torchtitan's Trainer.Config declares neither model_spec nor model "
                        f"(it has: {', '.join(declared_fields(cls))}).", PORT_FIX)


def fqn_root(trainer_config_cls=None) -> str:
    """Where the model config sits from the Trainer.Config root, as override FQNs name it."""
    return "model_spec.model" if model_field(trainer_config_cls) == "model_spec" else "model"


def model_spec(description: ModelDescription, spec_cls=None):
    """torchtitan's ModelSpec for `description`, built from the fields the installed ModelSpec declares: each
    one the description has; a required one it lacks stops here, naming it. A description field ModelSpec does
    not declare is dropped only when nothing is lost: `max_context_length` (the model config's RoPE carries it
    before #4328) or an unset hook."""
    cls = spec_cls or _model_spec_class()
    if cls is None:
        raise PipelineError("this torchtitan has no torchtitan.protocols.model_spec.ModelSpec (removed by #4810).",
                            "build the model with trainer_fields(), which gives Trainer.Config.model instead.")
    declared = declared_fields(cls)
    have = {f.name: getattr(description, f.name) for f in dataclasses.fields(description)}
    unknown = [name for name in required_fields(cls) if name not in have
               or (have[name] is None and "None" not in str(declared[name].type))]
    if unknown:
        raise PipelineError(f"torchtitan's ModelSpec requires {', '.join(unknown)}, which the pipeline does not describe "
                            "for this torchtitan "
                            f"(it describes: {', '.join(have)}).", PORT_FIX)
    lost = [name for name, value in have.items() if name not in declared and name != "max_context_length"
            and value is not None]
    if lost:
        raise PipelineError(f"torchtitan's ModelSpec has no field for {', '.join(lost)} (it declares: "
                            f"{', '.join(declared)}).", PORT_FIX)
    return cls(**{name: value for name, value in have.items() if name in declared})


def trainer_fields(description: ModelDescription, trainer_config_cls=None) -> dict[str, Any]:
    """The Trainer.Config keyword that carries the model: `model_spec=ModelSpec(…)`, or after #4810 `model=` the
    model config, whose class then has to own the adapter and hooks the description names (checked here)."""
    field = model_field(trainer_config_cls)
    if field == "model_spec":
        return {"model_spec": model_spec(description)}
    _check_model_class_owns(description)
    return {"model": description.model}


def _check_model_class_owns(description: ModelDescription) -> None:
    """After #4810 the model class carries what ModelSpec did (protocols/model.py: `state_dict_adapter_cls`); a
    description whose adapter its class does not own would train with another adapter: refused, naming both."""
    from pipeline.titan import accessors

    model_cls = accessors.config_owner(description.model)
    owned = getattr(model_cls, "state_dict_adapter_cls", None)
    if description.state_dict_adapter is not None and owned is not description.state_dict_adapter:
        raise PipelineError(
            f"torchtitan without ModelSpec takes the state-dict adapter from the model class: "
            f"{getattr(model_cls, '__qualname__', model_cls)} owns {getattr(owned, '__qualname__', owned)}, the "
            f"{description.name} path needs {description.state_dict_adapter.__qualname__}.", PORT_FIX)
