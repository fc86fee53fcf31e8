"""Typed training settings, read from configs/<target>.toml, with errors that name file and key.

A config file has a [train] table (defaults for every path) and optional [paths.<path>]
tables that override it for one training path. Unknown keys, wrong types and values
outside an allowed set are refused before anything is launched.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from pipeline.errors import PipelineError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
PATHS = ("hf", "native", "nki")
CHOICES = {
    "dtype": ("float32", "bfloat16"),
    "activation_checkpoint": ("none", "selective", "full"),
    "compile_backend": ("inductor", "neuron", "aot_eager"),
    "constraint_policy": ("error", "fallback"),
}


@dataclass(frozen=True)
class TrainSettings:
    nproc_per_node: int = 2
    nnodes: int = 1
    steps: int = 10
    seq_len: int = 128
    local_batch_size: int = 2
    lr: float = 1e-3
    warmup_steps: int = 2
    max_norm: float = 1.0
    dtype: str = "float32"
    seed: int = 0
    tensor_parallel: int = 1
    data_parallel_shard: int = -1
    sequence_parallel: bool = False
    activation_checkpoint: str = "none"
    compile: bool = False
    compile_backend: str = "inductor"
    checkpoint_interval: int = 5
    keep_latest_k: int = 2
    dataset: str = "local"
    tensorboard: bool = True
    flavor: str = ""
    lnc: int = 1
    constraint_policy: str = "error"
    nki_overrides: list = field(default_factory=list)


def _check_type(name: str, value, where: str):
    kind = {f.name: f.type for f in fields(TrainSettings)}[name]
    expected = {"int": int, "float": (int, float), "bool": bool, "str": str, "list": list}[kind]
    if isinstance(value, bool) and kind in ("int", "float"):
        expected = ()
    if not isinstance(value, expected):
        raise PipelineError(f"{where}: {name} = {value!r} is a {type(value).__name__}, expected {kind}.",
                            f"write {name} as a TOML {kind}.")
    if name in CHOICES and value not in CHOICES[name]:
        raise PipelineError(f"{where}: {name} = {value!r} is not allowed; allowed: {', '.join(CHOICES[name])}.",
                            f"set {name} to one of them.")
    return float(value) if kind == "float" else value


def _apply(base: TrainSettings, table: dict, where: str) -> TrainSettings:
    allowed = [f.name for f in fields(TrainSettings)]
    changes = {}
    for key, value in table.items():
        if key not in allowed:
            close = [a for a in allowed if a[:3] == key[:3]]
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise PipelineError(f"{where}: unknown key {key!r}{hint}; allowed: {', '.join(allowed)}.",
                                "remove or rename it.")
        changes[key] = _check_type(key, value, f"{where}")
    return replace(base, **changes)


def load(target: str, path: str, config_file: Path | None = None) -> TrainSettings:
    config_file = Path(config_file) if config_file else CONFIG_DIR / f"{target}.toml"
    try:
        data = tomllib.loads(config_file.read_text())
    except FileNotFoundError as err:
        raise PipelineError(f"{config_file} does not exist.", f"create it or pick TARGET from {list_targets()}.") from err
    except tomllib.TOMLDecodeError as err:
        raise PipelineError(f"{config_file} is not valid TOML: {err}.", "fix its syntax.") from err
    for key in data:
        if key not in ("train", "paths"):
            raise PipelineError(f"{config_file}: unknown table [{key}]; allowed: [train], [paths.<path>].",
                                "remove or rename it.")
    settings = _apply(TrainSettings(), data.get("train", {}), f"{config_file} [train]")
    for name in data.get("paths", {}):
        if name not in PATHS:
            raise PipelineError(f"{config_file}: unknown table [paths.{name}]; allowed paths: {', '.join(PATHS)}.",
                                "rename it.")
    return _apply(settings, data.get("paths", {}).get(path, {}), f"{config_file} [paths.{path}]")


def shared_with(settings: TrainSettings, record_type) -> dict:
    """The settings a RunSpec (or any record) carries under the same names, copied by name so the
    two can never drift apart field by field."""
    names = {f.name for f in fields(record_type)}
    return {f.name: getattr(settings, f.name) for f in fields(settings) if f.name in names}


def list_targets() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml") if p.stem != "models")


def with_overrides(settings: TrainSettings, **flags) -> TrainSettings:
    """Command-line values (STEPS=…, SEQ_LEN=…) over the config file; None means not given."""
    given = {k: v for k, v in flags.items() if v is not None}
    for key, value in given.items():
        if key in ("steps",) and value < 0:
            raise PipelineError(f"{key.upper()}={value} is negative.", f"give {key.upper()} ≥ 0.")
        if key in ("seq_len", "local_batch_size", "nproc_per_node", "nnodes") and value < 1:
            raise PipelineError(f"{key.upper()}={value} must be at least 1.", f"give {key.upper()} ≥ 1.")
    return replace(settings, **given)

