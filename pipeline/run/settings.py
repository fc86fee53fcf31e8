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
# Fields the two torchtitan APIs name differently (pipeline.titan.api names them): the sequence length
# (training.seq_len / training.max_context_length) and the per-rank batch (training.local_batch_size
# sequences / training.num_tokens_per_microbatch_per_dp_rank tokens).
TITAN_CONTEXT = "training.<context>"
TITAN_BATCH = "training.<batch>"


def setting(default, help: str | None = None, **facts):  # noqa: A002 - argparse's own word
    """A TrainSettings field with what is known about it, in its metadata (read through facts()/named()):
      choices    the values allowed;  minimum  the least value allowed (both checked by check_value, for
                 the config files, the flags and TITAN_ARGS alike)
      make       the Make variable that sets it; with `help` the field is also a flag of train and launch
                 (make_assigns and the other make_* keys: pipeline.flags)
      titan      the torchtitan Trainer.Config field it sets: TITAN_ARGS changing it is folded into it
      continues  True: a run continues under another value (more STEPS continue it; run.continuation)
      condition  True: a condition of configs/models.toml's expected step-1 loss (run.expectation)
      workload   True: what data and how much; a rehearsal takes it from cpu.toml (training.rehearsal)"""
    if help:
        return flag(default, help, **facts)
    if isinstance(default, list):
        return field(default_factory=list, metadata=facts)
    return field(default=default, metadata=facts)


@dataclass(frozen=True)
class TrainSettings:
    """Every training setting and its default (configs/<target>.toml and CONFIG= layer over these). A
    field with help is also a flag of `train` and `launch` (pipeline.flags), over the config files."""

    nproc_per_node: int = setting(2, "ranks per node (default: the target's config)", make="NPROC", minimum=1)
    nnodes: int = setting(1, minimum=1)
    steps: int = setting(10, "training steps", make="STEPS", minimum=0, titan="training.steps", continues=True,
                         workload=True)
    seq_len: int = setting(128, "sequence length", make="SEQ_LEN", minimum=1, titan=TITAN_CONTEXT, condition=True,
                           workload=True)
    local_batch_size: int = setting(2, minimum=1, titan=TITAN_BATCH, workload=True)
    lr: float = 1e-3
    warmup_steps: int = 2
    max_norm: float = setting(1.0, titan="training.max_norm")
    dtype: str = setting("float32", choices=dtypes.NAMES, titan="training.mixed_precision_param", condition=True)
    export_dtype: str = setting("bfloat16", "dtype of the model the last step saves in HF safetensors, what export "
                                "links (float32 for exact checks; export casts it down, never up)", make="DTYPE",
                                make_assigns=True, choices=dtypes.NAMES, continues=True)
    seed: int = setting(0, titan="debug.seed", workload=True)
    tensor_parallel: int = setting(1, titan="parallelism.tensor_parallel_degree")
    data_parallel_shard: int = setting(-1, titan="parallelism.data_parallel_shard_degree")
    sequence_parallel: bool = setting(False, titan="parallelism.enable_sequence_parallel")
    activation_checkpoint: str = setting("none", choices=("none", "selective", "full"))
    compile: bool = setting(False, titan="compile.enable")
    compile_backend: str = setting("inductor", choices=("inductor", "neuron", "aot_eager"), titan="compile.backend")
    # torchtitan Qwen3's attention (pipeline/models/attention_backends.py): flex needs Inductor
    # (CPU, CUDA); document_sdpa does not (neuron).
    attention_backend: str = setting("flex", choices=("flex", "document_sdpa"))
    checkpoint_interval: int = setting(5, titan="checkpoint.interval", workload=True)
    keep_latest_k: int = setting(2, titan="checkpoint.keep_latest_k", workload=True)
    dataset: str = setting("local", "local (the model's data/train.jsonl), a .jsonl/.txt file, a torchtitan dataset "
                           "(c4, c4_test) or a Hub dataset id org/name (default: the config's)", make="DATASET",
                           condition=True, workload=True)
    # Held-out eval loss every `eval_every` steps (0: off) over `eval_steps` batches of `eval_dataset`
    # ("": the dataset's own held-out split where it has one: DATASET=chat's data/chat_eval.jsonl).
    eval_every: int = 0
    eval_steps: int = 4
    eval_dataset: str = ""
    # The tokenizer the data is encoded with (pipeline/titan/tokenizer.py; its files: titan/assets.py):
    # the source checkpoint's own, or torchtitan's test tokenizer (AWS's smoke run; configs/models.toml).
    tokenizer: str = setting("model", choices=("model", "titan-test"), condition=True)
    tensorboard: bool = True
    # Weights & Biases through torchtitan's WandBLogger: project `wandb_project`, run name
    # <model key>/<run name>; WANDB_MODE=offline keeps it on disk (wandb sync uploads it later).
    wandb: bool = False
    wandb_project: str = "qwen3-pipeline"
    lnc: int = 1
    constraint_policy: str = setting("error", choices=("error", "fallback"))
    nki_overrides: list = field(default_factory=list)
    # LoRA (every path: pipeline.models.lora): rank 0 trains every weight; > 0 trains adapters of
    # that rank on `lora_targets` (default: attention and MLP projections), scaled alpha / rank.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: list = field(default_factory=list)
    # DPO (preference data: records with "chosen" and "rejected"; pipeline.titan.dpo): β, the strength of the
    # pull towards the reference, and the loss (TRL's DPOConfig.beta, loss_type and their defaults).
    dpo_beta: float = 0.1
    # DPO's loss on preference data (pipeline.titan.dpo.LOSS_TYPES; TRL's DPOConfig.loss_type of the same names).
    dpo_loss: str = setting("sigmoid", choices=("sigmoid", "ipo", "hinge"))

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


_FIELDS = {f.name: f for f in fields(TrainSettings)}


def facts(name: str) -> dict:
    """What is known about the setting `name` (its field's metadata, see setting())."""
    return dict(_FIELDS[name].metadata)


def named(fact: str) -> tuple[str, ...]:
    """The settings that have `fact` (set and true), in field order."""
    return tuple(f.name for f in fields(TrainSettings) if f.metadata.get(fact))


def check_value(name: str, value, where: str) -> None:
    """The one check of a setting's value against its field's choices and minimum, wherever it comes from."""
    known = _FIELDS[name].metadata
    if "choices" in known and value not in known["choices"]:
        raise PipelineError(f"{where}: {name} = {value!r} is not allowed; allowed: {', '.join(known['choices'])}.",
                            f"set {name} to one of them.")
    if "minimum" in known and value < known["minimum"]:
        said = "is negative" if known["minimum"] == 0 else f"must be at least {known['minimum']}"
        spelled = f"{known['make']}={value}" if "make" in known else f"{where}: {name} = {value!r}"
        raise PipelineError(f"{spelled} {said}.", f"give {known.get('make', name)} ≥ {known['minimum']}.")


_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str, "list": list}


def _check_type(name: str, value, where: str):
    kind = {f.name: f.type for f in fields(TrainSettings)}[name]
    expected = _TYPES[kind]
    if isinstance(value, bool) and kind in ("int", "float"):
        expected = ()
    if not isinstance(value, expected):
        raise PipelineError(f"{where}: {name} = {value!r} is a {type(value).__name__}, expected {kind}.",
                            f"write {name} as a TOML {kind}.")
    check_value(name, value, where)
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
    """The targets with a settings file: configs/<target>.toml (configs/ holds other records too)."""
    from pipeline.run.targets import TARGETS

    return sorted(p.stem for p in CONFIG_DIR.glob("*.toml") if p.stem in TARGETS)


def with_flags(settings: TrainSettings, **flags) -> TrainSettings:
    """Command-line values (STEPS=…, SEQ_LEN=…) over the config files; None means not given."""
    given = {k: v for k, v in flags.items() if v is not None}
    for key, value in given.items():
        check_value(key, value, "the command line")
    return replace(settings, **given)


def to_dict(settings: TrainSettings) -> dict:
    return {f.name: getattr(settings, f.name) for f in fields(settings)}


def from_dict(data: dict) -> TrainSettings:
    known = {f.name for f in fields(TrainSettings)}
    return TrainSettings(**{k: v for k, v in data.items() if k in known})
