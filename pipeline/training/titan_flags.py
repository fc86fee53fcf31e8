"""TITAN_ARGS against what the pipeline owns: folded into its settings, or refused, before any check.

The launcher's checks (parallel degrees, kernel constraints), the memory estimate and the run
directory all read the pipeline's settings. A torchtitan flag that changes one of them behind the
settings' back (`--parallelism.tensor_parallel_degree 1`) would train one plan while the dry run
prints and checks another. So the flags are parsed over the config the ranks would build, and every
field below that they change is either folded into the settings (then checked like STEPS= or a
CONFIG value) or refused in one line naming the pipeline's own way to set it. Fields not listed
(warmup, logging, the optimizer's kwargs, …) are torchtitan's to tune and pass through as they are.
"""

from __future__ import annotations

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


# Fields the two torchtitan APIs name differently (pipeline.titan.api names them): the sequence length
# (training.seq_len / training.max_context_length) and the per-rank batch (training.local_batch_size
# sequences / training.num_tokens_per_microbatch_per_dp_rank tokens).
CONTEXT = "training.<context>"
BATCH = "training.<batch>"

FOLDED = (
    Folded("training.steps", "steps", "STEPS="),
    Folded(CONTEXT, "seq_len", "SEQ_LEN="),
    Folded(BATCH, "local_batch_size", "local_batch_size in CONFIG"),
    Folded("training.mixed_precision_param", "dtype", "dtype in CONFIG"),
    Folded("training.max_norm", "max_norm", "max_norm in CONFIG"),
    Folded("parallelism.tensor_parallel_degree", "tensor_parallel", "tensor_parallel in CONFIG"),
    Folded("parallelism.data_parallel_shard_degree", "data_parallel_shard", "data_parallel_shard in CONFIG"),
    Folded("parallelism.enable_sequence_parallel", "sequence_parallel", "sequence_parallel in CONFIG"),
    Folded("checkpoint.interval", "checkpoint_interval", "checkpoint_interval in CONFIG"),
    Folded("checkpoint.keep_latest_k", "keep_latest_k", "keep_latest_k in CONFIG"),
    Folded("compile.enable", "compile", "compile in CONFIG"),
    Folded("compile.backend", "compile_backend", "compile_backend in CONFIG"),
    Folded("debug.seed", "seed", "seed in CONFIG"),
)

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
