"""TITAN_ARGS against what the pipeline owns: folded into its settings, or refused, before any check.

The launcher's checks (parallel degrees, kernel constraints), the memory estimate and the run
directory all read the pipeline's settings. A torchtitan flag that changes one of them behind the
settings' back (`--parallelism.tensor_parallel_degree 1`) would train one plan while the dry run
prints and checks another. So the flags are parsed over the config the ranks would build, and every
field below that they change is either folded into the settings (then checked like STEPS= or a
CONFIG value) or refused in one line naming the pipeline's own way to set it. Every path option of the
installed torchtitan's config (a string field named …folder, …path, …dir, …file: path_fields, read
from its dataclasses, not listed by hand) is refused too: the run's files (metrics.jsonl, the first
batch, TensorBoard, traces) stay in its run directory, where export and verify read them. Fields not
listed (warmup, logging, the optimizer's kwargs, …) are torchtitan's to tune and pass through as they are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from pipeline.errors import PipelineError
from pipeline.run import settings as settings_mod
from pipeline.run.settings import TrainSettings
from pipeline.run.spec import RunSpec
from pipeline.titan import api
from pipeline.titan.args import apply_titan_args


@dataclass(frozen=True)
class Folded:
    field: str  # dotted path in torchtitan's Trainer.Config
    setting: str  # the TrainSettings field it becomes
    how: str  # where a user sets it the pipeline's way (the dry run's note names it)


@dataclass(frozen=True)
class Refused:
    field: str
    why: str
    fix: str
    apis: tuple[str, ...] = (api.V030, api.MAIN)  # the torchtitan APIs that have the field


def owned() -> tuple:
    """The folded and refused entries the installed torchtitan has fields for."""
    return (*FOLDED, *(r for r in REFUSED if api.variant() in r.apis))


# The sequence length and the per-rank batch, which the two torchtitan APIs name differently.
CONTEXT, BATCH = settings_mod.TITAN_CONTEXT, settings_mod.TITAN_BATCH


def _how(name: str) -> str:
    facts = settings_mod.facts(name)
    return f"{facts['make']}=" if "make" in facts else f"{name} in CONFIG"


# Every setting whose field names the torchtitan field it sets (pipeline.run.settings: `titan`).
FOLDED = tuple(Folded(settings_mod.facts(name)["titan"], name, _how(name)) for name in settings_mod.named("titan"))

_RUN_DIR = "the pipeline keeps a run's checkpoints, metrics and logs in its run directory, which export and verify read"
_PLAN = "the pipeline plans, checks and estimates TP × FSDP only"
REFUSED = (
    Refused("checkpoint.folder", _RUN_DIR, "choose the checkpoints root with PIPELINE_CHECKPOINTS (or FRESH=1 to restart)."),
    Refused("dump_folder", _RUN_DIR, "choose the checkpoints root with PIPELINE_CHECKPOINTS."),
    Refused("checkpoint.enable", _RUN_DIR, "leave checkpointing on; checkpoint_interval in CONFIG sets how often."),
    Refused("checkpoint.last_save_model_only", "export reads the last step's full checkpoint",
            "leave it to the pipeline."),
    Refused("checkpoint.initial_load_path", "the model a run starts from is MODEL's checkpoint", "use MODEL= (and REVISION=)."),
    Refused("checkpoint.initial_load_in_hf", "the model a run starts from is MODEL's checkpoint", "use MODEL=."),
    Refused("checkpoint.initial_load_model_only", "the model a run starts from is MODEL's checkpoint", "use MODEL=."),
    Refused("hf_assets_path", "the tokenizer and weights are MODEL's", "use MODEL=."),
    Refused("dataloader.dataset", "the data is resolved and checked by the pipeline", "use DATASET=."),
    # main's Grain loader takes no dataset path (and its `dataset` is not a flag tyro offers)
    Refused("dataloader.dataset_path", "the data is resolved and checked by the pipeline", "use DATASET=.",
            apis=(api.V030,)),
    Refused("training.dtype", "parameters are float32 masters; dtype sets the compute precision", "set dtype in CONFIG."),
    Refused("activation_checkpoint", "the memory estimate reads the checkpointing mode from the settings",
            'set activation_checkpoint ("none", "selective", "full") in CONFIG.'),
    Refused("parallelism.data_parallel_replicate_degree", _PLAN, "set tensor_parallel / data_parallel_shard in CONFIG."),
    Refused("parallelism.pipeline_parallel_degree", _PLAN, "set tensor_parallel / data_parallel_shard in CONFIG."),
    Refused("parallelism.context_parallel_degree", _PLAN, "set tensor_parallel / data_parallel_shard in CONFIG."),
    Refused("parallelism.expert_parallel_degree", _PLAN, "set tensor_parallel / data_parallel_shard in CONFIG."),
)

_MISSING = object()


def _path(config, field: str) -> str:
    return {CONTEXT: f"training.{api.context_field()}", BATCH: f"training.{api.batch_field()}"}.get(field, field)


def _get(config, dotted: str):
    value = config
    for part in dotted.split("."):
        value = getattr(value, part, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value


def _flag(dotted: str, value) -> str:
    return f"--{dotted} {value}"


def changed_fields(base, parsed) -> dict[str, tuple[object, object]]:
    """Every owned field (folded or refused) whose value the flags change: path → (built, parsed)."""
    out = {}
    for entry in owned():
        dotted = _path(base, entry.field)
        before, after = _get(base, dotted), _get(parsed, dotted)
        if before is not _MISSING and before != after:
            out[dotted] = (before, after)
    return out


PATH_WORDS = {"folder", "path", "dir", "directory", "file"}  # a word of a field's name that makes it a path option


def path_fields(config, prefix: str = "") -> list[str]:
    """The dotted names of every path option of a built Trainer.Config: a string (or unset optional
    string) field one of whose name's words is a PATH_WORDS, in any nested config dataclass."""
    found = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name, None)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            found += path_fields(value, f"{prefix}{field.name}.")
        elif (isinstance(value, str) or (value is None and "str" in str(field.type))) \
                and PATH_WORDS & set(field.name.lower().split("_")):
            found.append(prefix + field.name)
    return found


def _refuse_moved_paths(spec: RunSpec, base, parsed) -> None:
    for dotted in path_fields(base):
        before, after = _get(base, dotted), _get(parsed, dotted)
        if before != after:
            raise PipelineError(f"TITAN_ARGS {_flag(dotted, after)}: a path option; the run keeps its files ({dotted} "
                                f"{before!r}) in its run directory {spec.run_dir}, where export, verify and a resume "
                                "read them.",
                                "drop the flag: RUN_NAME= names the run's directory, PIPELINE_CHECKPOINTS= the root it "
                                "lies in.")


def fold(spec: RunSpec) -> TrainSettings:
    """The settings with TITAN_ARGS' changes to pipeline-owned fields folded in; a PipelineError for a
    field the pipeline owns without a setting, or for a folded value its settings refuse."""
    from pipeline.training import entry

    base = entry.build_config(replace(spec, titan_args=[]))
    parsed = apply_titan_args(base, list(spec.titan_args))
    changes = changed_fields(base, parsed)
    for refused in REFUSED:
        dotted = _path(base, refused.field)
        if dotted in changes:
            raise PipelineError(f"TITAN_ARGS {_flag(dotted, changes[dotted][1])}: {refused.why}.", refused.fix)
    _refuse_moved_paths(spec, base, parsed)  # after REFUSED: a path it names is refused with its own fix
    folded = {}
    for owned in FOLDED:
        dotted = _path(base, owned.field)
        if dotted in changes:
            folded[owned.setting] = (dotted, changes[dotted][1])
    settings = spec.settings
    for setting, (dotted, value) in folded.items():
        if setting == "local_batch_size" and api.folded_batch():  # main counts the batch in tokens
            if value % settings.seq_len:
                raise PipelineError(f"TITAN_ARGS {_flag(dotted, value)}: not a whole number of {settings.seq_len}-token "
                                    "sequences.", "set local_batch_size in CONFIG.")
            value //= settings.seq_len
        try:
            settings = settings_mod.with_flags(settings, **{setting: value})
        except PipelineError as err:
            raise PipelineError(f"TITAN_ARGS {_flag(dotted, value)}: {err.problem}", err.fix) from None
    return settings


def summary(before: TrainSettings, after: TrainSettings) -> str | None:
    """One line naming what TITAN_ARGS changed in the settings (printed by the dry run), or None."""
    how = {owned.setting: owned.how for owned in FOLDED}
    names = [f"{name} {getattr(before, name)!r} → {getattr(after, name)!r} ({how.get(name, 'CONFIG')} next time)"
             for name in settings_mod.to_dict(after) if getattr(before, name) != getattr(after, name)]
    return f"TITAN_ARGS folded into the settings (the checks and the estimate use them): {', '.join(names)}" \
        if names else None
