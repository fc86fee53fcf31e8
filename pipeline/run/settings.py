"""Typed training settings, layered: target defaults, then a user's config file, then flags.

A config file has a [train] table (every path) and optional [paths.<path>] tables (one training
path). `configs/<target>.toml` gives the defaults; a user's file (CONFIG=, --config) overrides them
key by key; command-line values (STEPS=, SEQ_LEN=, …) override both. Unknown keys, wrong types and
values outside an allowed set are refused, naming file and key, before anything is launched.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from pipeline import dtypes
from pipeline.flags import flag
from pipeline.errors import PipelineError

CONFIG_DIR = Path(__file__).resolve().parent.parent.parent / "configs"
CHOICES = {
    "dtype": dtypes.NAMES,
    "export_dtype": dtypes.NAMES,
    "activation_checkpoint": ("none", "selective", "full"),
    "compile_backend": ("inductor", "neuron", "aot_eager"),
    "constraint_policy": ("error", "fallback"),
    # torchtitan Qwen3's attention (pipeline/models/attention_backends.py): flex needs Inductor
    # (CPU, CUDA); document_sdpa does not (neuron).
    "attention_backend": ("flex", "document_sdpa"),
    # The tokenizer the data is encoded with (pipeline/training/tokenizer.py): the source
    # checkpoint's own, or torchtitan's test tokenizer (AWS's smoke run; configs/models.toml).
    "tokenizer": ("model", "titan-test"),
}


@dataclass(frozen=True)
class TrainSettings:
    """Every training setting and its default (configs/<target>.toml and CONFIG= layer over these). A
    field with help is also a flag of `train` and `launch` (pipeline.flags), over the config files."""

    nproc_per_node: int = flag(2, "ranks per node (default: the target's config)")
    nnodes: int = 1
    steps: int = flag(10, "training steps")
    seq_len: int = flag(128, "sequence length")
    local_batch_size: int = 2
    lr: float = 1e-3
    warmup_steps: int = 2
    max_norm: float = 1.0
    dtype: str = "float32"
    export_dtype: str = flag("bfloat16", "dtype of the model the last step saves in HF safetensors, what export links "
                             "(float32 for exact checks; export casts it down, never up)", choices=dtypes.NAMES)
    seed: int = 0
    tensor_parallel: int = 1
    data_parallel_shard: int = -1
    sequence_parallel: bool = False
    activation_checkpoint: str = "none"
    compile: bool = False
    compile_backend: str = "inductor"
    attention_backend: str = "flex"
    checkpoint_interval: int = 5
    keep_latest_k: int = 2
    dataset: str = flag("local", "local (the model's data/train.jsonl), a .jsonl/.txt file, a torchtitan dataset (c4, "
                        "c4_test) or a Hub dataset id org/name (default: the config's)")
    # Held-out eval loss every `eval_every` steps (0: off) over `eval_steps` batches of `eval_dataset`
    # ("": the dataset's own held-out split where it has one: DATASET=chat's data/chat_eval.jsonl).
    eval_every: int = 0
    eval_steps: int = 4
    eval_dataset: str = ""
    tokenizer: str = "model"
    tensorboard: bool = True
    # Weights & Biases through torchtitan's WandBLogger: project `wandb_project`, run name
    # <model key>/<run name>; WANDB_MODE=offline keeps it on disk (wandb sync uploads it later).
    wandb: bool = False
    wandb_project: str = "qwen3-pipeline"
    lnc: int = 1
    constraint_policy: str = "error"
    nki_overrides: list = field(default_factory=list)
    # LoRA (native, nki: pipeline.models.lora): rank 0 trains every weight; > 0 trains adapters of
    # that rank on `lora_targets` (default: attention and MLP projections), scaled alpha / rank.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: list = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str, "list": list}


def _check_type(name: str, value, where: str):
    kind = {f.name: f.type for f in fields(TrainSettings)}[name]
    expected = _TYPES[kind]
    if isinstance(value, bool) and kind in ("int", "float"):
        expected = ()
    if not isinstance(value, expected):
        raise PipelineError(f"{where}: {name} = {value!r} is a {type(value).__name__}, expected {kind}.",
                            f"write {name} as a TOML {kind}.")
    if name in CHOICES and value not in CHOICES[name]:
        raise PipelineError(f"{where}: {name} = {value!r} is not allowed; allowed: {', '.join(CHOICES[name])}.",
                            f"set {name} to one of them.")
    return float(value) if kind == "float" else value


def closest(name: str, known: Iterable[str]) -> str:
    """' (did you mean X?)' for the nearest known name, or ''."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def _table_changes(table: dict, where: str) -> dict:
    allowed = [f.name for f in fields(TrainSettings)]
    changes = {}
    for key, value in table.items():
        if key not in allowed:
            raise PipelineError(f"{where}: unknown key {key!r}{closest(key, allowed)}; allowed: {', '.join(allowed)}.",
                                "remove or rename it.")
        changes[key] = _check_type(key, value, where)
    return changes


def _read(config_file: Path, paths: Iterable[str], users: bool = False) -> dict:
    """A config file's tables; `users`: the CONFIG= file (a missing one is a wrong path, not a wrong TARGET)."""
    from pipeline.fsutil import read_small_text

    fix = "check the CONFIG path (a TOML file with a [train] table)." if users else \
        f"create it, or pick TARGET from {list_targets()}."
    try:
        data = tomllib.loads(read_small_text(Path(config_file), fix=fix))
    except FileNotFoundError as err:
        raise PipelineError(f"config file {config_file} does not exist.", fix) from err
    except tomllib.TOMLDecodeError as err:
        raise PipelineError(f"{config_file} is not valid TOML: {err}.", "fix its syntax.") from err
    for key in data:
        if key not in ("train", "paths"):
            raise PipelineError(f"{config_file}: unknown table [{key}]; allowed: [train], [paths.<path>].",
                                "remove or rename it.")
    for name in data.get("paths", {}):
        if name not in paths:
            raise PipelineError(f"{config_file}: unknown table [paths.{name}]{closest(name, paths)}; "
                                f"allowed paths: {', '.join(paths)}.", "rename it.")
    return data


def load(target: str, path: str, paths: Iterable[str], user_config: Path | None = None) -> TrainSettings:
    """configs/<target>.toml, then `user_config` over it key by key; [paths.<path>] over [train] in each."""
    paths = tuple(paths)
    settings = TrainSettings()
    for config_file, users in ((CONFIG_DIR / f"{target}.toml", False), (user_config, True)):
        if config_file is None:
            continue
        data = _read(config_file, paths, users)
        settings = replace(settings, **_table_changes(data.get("train", {}), f"{config_file} [train]"))
        table = data.get("paths", {}).get(path, {})
        settings = replace(settings, **_table_changes(table, f"{config_file} [paths.{path}]"))
    return settings


def list_targets() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml") if p.stem != "models")


def with_flags(settings: TrainSettings, **flags) -> TrainSettings:
    """Command-line values (STEPS=…, SEQ_LEN=…) over the config files; None means not given."""
    given = {k: v for k, v in flags.items() if v is not None}
    for key, value in given.items():
        if key == "steps" and value < 0:
            raise PipelineError(f"STEPS={value} is negative.", "give STEPS ≥ 0.")
        if key in ("seq_len", "local_batch_size", "nproc_per_node", "nnodes") and value < 1:
            raise PipelineError(f"{key.upper()}={value} must be at least 1.", f"give {key.upper()} ≥ 1.")
    return replace(settings, **given)


def to_dict(settings: TrainSettings) -> dict:
    return {f.name: getattr(settings, f.name) for f in fields(settings)}


def from_dict(data: dict) -> TrainSettings:
    known = {f.name for f in fields(TrainSettings)}
    return TrainSettings(**{k: v for k, v in data.items() if k in known})
