"""Every torchtitan name, dataclass field and signature the pipeline uses, listed once, and the check that the
installed torchtitan has them.

TORCHTITAN_INTERNALS lists the private names (the pipeline's modules reach them only through
`pipeline.titan.accessors`, the one other module that names them; the test of this module checks that no other
does), PUBLIC_NAMES the public ones (every `from torchtitan… import` in pipeline/ is among them: the test checks
that too), with the fields and keywords the pipeline relies on, and GLUE_INTERNALS what `pipeline.titan.patches`
replaces for each target. A name some APIs lack says on which it is used (`apis`); where torchtitan moved a thing,
a OneOf takes either. `check_torchtitan()` runs in the launcher before any rank starts, and `python -m pipeline
doctor --titan` prints the whole table (the trn2 workflow's first step in the image): on a torchtitan without
one of them (torchtitan-neuron "0.2.2+neuron.1" may be such a one), what is missing is named.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass

from pipeline.errors import PipelineError
from pipeline.titan import api

# The torchtitan these names were read from: the dev lock's 0.3.0, and upstream main of 2026-08-21
# (TITAN_MAIN_WHEEL; the nearest public snapshot of torchtitan-neuron's base, docs/sources.md), where they all exist too. The
# image's torchtitan-neuron must have them, which check_torchtitan() verifies before anything is launched.
EXPECTED_TORCHTITAN = "0.3.0"
WRITTEN_AGAINST = "0.3.0 and upstream main of 2026-08-21"
# (version, API) pairs the test suite checks every name on (the fast tier, the upstream-main tier and the
# simulated "main after #4328" tier, whose wheel tests/titan_sim.py versions 0.2.2+sim.pr4328): the launcher
# skips importing torchtitan for them. upstream main says 0.2.2 with the main API; PyPI's own 0.2.2 has the
# old one, and torchtitan-neuron ("0.2.2+neuron.1") is always checked.
VERIFIED = {(EXPECTED_TORCHTITAN, api.V030), ("0.2.2", api.MAIN), ("0.2.2+sim.pr4328", api.MAIN)}


@dataclass(frozen=True)
class TitanName:
    module: str
    name: str  # attribute path inside the module ("Class.method"); "" for the module itself
    why: str
    parameter: str | None = None  # a keyword the callable must accept
    field: str | None = None  # a dataclass field the class must declare
    apis: tuple[str, ...] = ()  # the torchtitan APIs (titan.api) the pipeline uses it on; () = every one

    @property
    def qualname(self) -> str:
        base = ".".join(p for p in (self.module, self.name) if p)
        return base + (f"({self.parameter}=)" if self.parameter else "") + (f".{self.field}" if self.field else "")

    @property
    def kind(self) -> str:
        private = any(part.startswith("_") for part in (self.name.split(".") + [self.parameter or "", self.field or ""]))
        what = "field" if self.field else "keyword" if self.parameter else "name"
        return f"{'private' if private else 'public'} {what}"

    def missing(self) -> str | None:
        """None when the installed torchtitan has it; else why not (a module failing on import counts as lacking)."""
        try:
            obj = _resolve(self)
            if self.parameter and self.parameter not in inspect.signature(obj).parameters:
                return "no such keyword"
            if self.field and self.field not in {f.name for f in dataclasses.fields(obj)}:
                return "no such field"
        except ModuleNotFoundError as err:
            # its module, or a module it imports (torchtitan.trainer needs triton): named, it says which
            return "absent" if (err.name or "").startswith(self.module) else f"import failed: {str(err)[:120]}"
        except (ImportError, AttributeError):
            return "absent"
        except Exception as err:  # noqa: BLE001 - a module failing on import is a missing name too
            return f"import failed: {type(err).__name__}: {str(err)[:120]}"
        return None


@dataclass(frozen=True)
class OneOf:
    """Where torchtitan moved something the pipeline uses: any option will do (titan.model_spec picks it)."""

    options: tuple[TitanName, ...]
    why: str
    apis: tuple[str, ...] = ()

    @property
    def qualname(self) -> str:
        return " | ".join(o.qualname for o in self.options)

    @property
    def kind(self) -> str:
        return "one of"

    def missing(self) -> str | None:
        return None if any(o.missing() is None for o in self.options) else "none of them"

    def found(self) -> str:
        return next((o.qualname for o in self.options if o.missing() is None), "none")


@dataclass(frozen=True)
class RequiredFields:
    """A torchtitan dataclass the pipeline builds from its declared fields (titan/model_spec.py): every field it
    requires must be one the pipeline supplies (#4328 made ModelSpec require max_context_length)."""

    module: str
    name: str
    why: str
    apis: tuple[str, ...] = ()

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name} (required fields)"

    @property
    def kind(self) -> str:
        return "required fields"

    def _state(self) -> tuple[str | None, str]:
        from pipeline.titan import model_spec

        try:
            cls = _resolve(TitanName(self.module, self.name, self.why))
        except (ImportError, AttributeError):
            return None, "absent (torchtitan after #4810: the model config goes to Trainer.Config.model)"
        supplied = {f.name for f in dataclasses.fields(model_spec.ModelDescription)}
        unknown = [f for f in model_spec.required_fields(cls) if f not in supplied]
        if unknown:
            return f"requires {', '.join(unknown)}, which the pipeline does not supply", ""
        return None, "ok: " + ", ".join(model_spec.required_fields(cls))

    def missing(self) -> str | None:
        return self._state()[0]

    def found(self) -> str:
        return self._state()[1]


def _n(module: str, name: str, why: str, **kw) -> TitanName:
    return TitanName(module, name, why, **kw)


def _fields(module: str, cls: str, why: str, names: str, **kw) -> tuple[TitanName, ...]:
    return tuple(TitanName(module, cls, why, field=f, **kw) for f in names.split())


V030, MAIN = (api.V030,), (api.MAIN,)
CFG, COMP, DIST, HFD, COMMON = ("torchtitan.config", "torchtitan.components", "torchtitan.distributed",
                                "torchtitan.hf_datasets", "torchtitan.models.common")

PUBLIC_NAMES = (
    # How a model reaches the trainer (titan/model_spec.py).
    RequiredFields("torchtitan.protocols.model_spec", "ModelSpec", "the model spec every path builds"),
    OneOf((_n("torchtitan.trainer", "Trainer.Config", "", field="model_spec"),
           _n("torchtitan.trainer", "Trainer.Config", "", field="model")),
          "the model's place in Trainer.Config (ModelSpec until #4810, the model config after)"),
    OneOf((_n("torchtitan.protocols.model_spec", "ModelSpec", ""),
           _n("torchtitan.protocols.model", "BaseModel.state_dict_adapter_cls", "")),
          "the state-dict adapter's holder: ModelSpec, or the model class after #4810"),
    OneOf((_n(f"{COMMON}.rope", "RoPE.Config", "", field="max_seq_len"),
           _n(f"{COMMON}.rope", "RoPE.Config", "", field="max_context_length")),
          "RoPE cache length, sized at the run's seq_len (max_seq_len → max_context_length, #4121)"),
    _n("torchtitan.trainer", "Trainer", "the trainer PipelineTrainer extends (titan/trainer.py)"),
    _n("torchtitan.protocols.model", "BaseModel", "the hf path's model class (models/hf/model.py)"),
    _n("torchtitan.protocols.model", "BaseModel.Config.update_from_config", "the hf path's length check",
       parameter="config"),
    _n("torchtitan.protocols.module", "Module", "LoRA's frozen configs are traversed as Module configs"),
    _n("torchtitan.protocols.state_dict_adapter", "StateDictAdapter", "the hf path's adapter"),
    _n("torchtitan.models", "qwen3", "torchtitan's Qwen3 (native and nki paths)"),
    _n("torchtitan.models.qwen3", "Qwen3Model.Config", "the native model config"),
    _n("torchtitan.models.qwen3", "Qwen3StateDictAdapter", "native HF import/export keys"),
    _n(COMMON, "CosSinRoPE", "native RoPE"), _n(COMMON, "Embedding", "native embedding"),
    _n(COMMON, "Linear", "native lm_head"),
    _n(f"{COMMON}.rope", "CosSinRoPE", "the NKI RoPE's base"),
    _n(f"{COMMON}.attention", "FlexAttention", "replaced by the CPU attention"),
    _n(f"{COMMON}.attention", "VarlenAttention", "document_sdpa's base"),
    _n(f"{COMMON}.attention", "VarlenMetadata", "document_sdpa's packed-document metadata"),
    _n(f"{COMMON}.moe", "GroupedExperts", "replaced by the loop and NKI experts"),
    _n(f"{COMMON}.moe", "RoutedExperts", "kernel check's experts reference"),
    _n(f"{COMMON}.moe", "TokenChoiceTopKRouter", "replaced by the NKI router"),
    _n(f"{COMMON}.token_dispatcher", "LocalTokenDispatcher", "kernel check's dispatch"),
    _n(f"{CFG}", "override", "@override of the CPU, attention and NKI modules"),
    *(_n(f"{CFG}", "override", "@override's keywords", parameter=p) for p in ("target", "fqns", "description", "exact")),
    _n(f"{CFG}", "derive", "replacement configs from the replaced ones"),
    _n(f"{CFG}.override", "OverrideConfig", "override.imports", field="imports"),
    _n(f"{CFG}.configurable", "Configurable", "override FQNs: the config tree's node type"),
    _n(f"{CFG}.manager", "ConfigManager", "TITAN_ARGS: torchtitan's parser rules"),
    _n(f"{CFG}.manager", "custom_registry", "TITAN_ARGS: torchtitan's parser rules"),
    _n(f"{CFG}", "TORCH_DTYPE_MAP", "the hf path's FSDP dtypes"),
    *_fields(CFG, "TrainingConfig", "steps, clipping, dtypes (titan/api.py)",
             "steps max_norm dtype mixed_precision_param mixed_precision_reduce disable_cuda_graphs"),
    *_fields(CFG, "TrainingConfig", "[B, L] batches", "local_batch_size seq_len", apis=V030),
    *_fields(CFG, "TrainingConfig", "[T] folded batches (#4121)", "num_tokens_per_microbatch_per_dp_rank "
             "max_context_length", apis=MAIN),
    *_fields(CFG, "ParallelismConfig", "the plan", "data_parallel_shard_degree tensor_parallel_degree "
             "enable_sequence_parallel fsdp_reshard_after_forward"),
    *_fields(CFG, "CompileConfig", "compile settings", "enable backend components"),
    *_fields(f"{CFG}.configs", "CommConfig", "collective timeouts", "init_timeout_seconds train_timeout_seconds"),
    *_fields(f"{CFG}.configs", "DebugConfig", "seed, determinism", "seed deterministic"),
    *_fields(f"{COMP}.loss", "CrossEntropyLoss.Config", "the loss", "global_vocab_size"),
    *_fields(f"{COMP}.loss", "ChunkedLossWrapper.Config", "the LM head on labelled positions only (titan/labelled_loss.py)",
             "num_chunks loss_fn"),
    _n(f"{COMP}.loss", "ChunkedLossWrapper.set_lm_head", "the trainer hands the wrapper its lm_head"),
    _n(f"{COMP}.loss", "IGNORE_INDEX", "the label of positions without a loss"),
    _n(f"{COMP}.loss", "_LossParallelCrossEntropy", "DPO's per-token log-probabilities over TP's vocabulary shards"),
    _n("torchtitan.distributed.utils", "get_spmd_backend", "DPO: whether TP hands the loss vocabulary shards"),
    _n("torchtitan.distributed.spmd_types", "spmd_mesh_size", "DPO: the TP degree of the current mesh"),
    _n("torchtitan.distributed.spmd_types", "current_spmd_mesh", "DPO: the TP group of the vocabulary shards"),
    _n(f"{COMMON}.decoder", "Decoder._skip_lm_head", "the model returns hidden states for the wrapper"),
    *_fields(f"{COMP}.optimizer", "LRSchedulersContainer.Config", "warmup, decay", "warmup_steps decay_type"),
    _n(f"{COMP}.optimizer", "default_adamw", "AdamW", parameter="lr"),
    _n(f"{COMP}.optimizer", "register_moe_load_balancing_hook", "native MoE's optimizer hook"),
    *_fields(f"{COMP}.validate", "Validator.Config", "eval loss", "enable freq steps dataloader"),
    *_fields(f"{COMP}.metrics", "MetricsProcessor.Config", "metrics.jsonl's processor",
             "log_freq enable_tensorboard enable_wandb disable_color_printing"),
    _n(f"{COMP}.metrics", "DeviceMemStats", "CPU/trn2 memory statistics"),
    *_fields(f"{COMP}.checkpointer", "CheckpointManager.Config", "HF load, DCP saves, the HF save",
             "enable folder interval initial_load_path initial_load_in_hf initial_load_model_only "
             "last_save_model_only export_dtype keep_latest_k"),
    _n(f"{COMP}.checkpointer", "CheckpointManager.dcp_save", "the last step's HF save", parameter="to_hf"),
    _n(f"{COMP}.checkpointer", "AsyncMode", "a synchronous HF save"),
    _n(f"{COMP}.checkpointer", "MODEL", "the model's key in a checkpoint's state"),
    *_fields(f"{COMP}.lora", "LoRAConverter.Config", "LoRA adapters", "rank alpha target_modules"),
    _n(f"{COMP}.tokenizer", "HuggingFaceTokenizer", "the tokenizer (titan/tokenizer.py)"),
    _n(f"{DIST}.activation_checkpoint", "FullAC", "activation_checkpoint = full"),
    _n(f"{DIST}.activation_checkpoint", "SelectiveAC", "activation_checkpoint = selective"),
    _n(f"{DIST}.compile", "apply_compile", "the hf path's compile"),
    _n(f"{DIST}.fsdp", "disable_fsdp_gradient_division", "the hf path's FSDP"),
    _n(f"{DIST}.fsdp", "get_fsdp_reshard_after_forward_policy", "the hf path's FSDP"),
    _n(f"{DIST}.pipeline_parallel", "pipeline_llm", "native's pipelining function"),
    _n(f"{DIST}.tensor_parallel", "NoParallel", "the hf path's TP plan"),
    _n(f"{HFD}.text_datasets", "DATASETS", "text datasets by name"),
    _n(HFD, "text_datasets", "text datasets (chat.py)"),
    _n(HFD, "DatasetConfig", "a file or Hub dataset", apis=V030),
    _n(f"{HFD}.text_datasets", "HuggingFaceTextDataLoader", "the text loader", apis=V030),
    _n(f"{HFD}.text_datasets", "ChatDataset", "multi-turn chat SFT", apis=V030),
    _n(f"{COMP}.dataloader", "ParallelAwareDataloader", "the chat and preference-pair loaders", apis=V030),
    _n(f"{COMP}.data.loader", "BaseDataLoader", "the preference-pair loader", apis=MAIN),
    *(_n(f"{COMP}.data", n, "the Grain loader (#4121)", apis=MAIN) for n in (
        "GrainDataLoader", "ConcatThenSplitPackingConfig", "FirstFitPackingConfig", "HuggingFaceRandomAccessSource",
        "HuggingFaceStreamingSource", "SingleDatasetConfig")),
    _n(f"{COMP}.data.dataset", "TextSequence", "multi-turn chat SFT", apis=MAIN),
    _n(f"{HFD}.text_datasets", "TextProcessor", "text tokenisation", apis=MAIN),
    _n(f"{HFD}.text_datasets", "ChatProcessor", "multi-turn chat SFT", apis=MAIN),
    _n("torchtitan.tools.logging", "init_logger", "rank logging"),
    _n("torchtitan.tools.logging", "logger", "rank logging"),
    _n("torchtitan.components", "metrics", "patched (titan/patches.py)"),
    _n("torchtitan.distributed", "utils", "patched (titan/patches.py)"),
    _n(f"{COMMON}", "attention", "patched (titan/patches.py)"),
    _n(f"{COMMON}", "decoder", "patched (titan/patches.py)"),
)


TORCHTITAN_INTERNALS = (
    # torchtitan ships Qwen3 only as named flavors; these builders make layers with a checkpoint's own
    # shapes and keep torchtitan's layer and init conventions (models/native.py).
    TitanName("torchtitan.models.qwen3", "_build_qwen3_layers", "dense Qwen3 layers from config.json"),
    TitanName("torchtitan.models.qwen3", "_build_qwen3_moe_layers", "MoE Qwen3 layers from config.json"),
    TitanName("torchtitan.models.qwen3", "_qwen3_norm", "Qwen3's RMSNorm config"),
    TitanName("torchtitan.models.qwen3", "_EPS", "Qwen3's RMSNorm eps (checked against config.json)"),
    TitanName("torchtitan.models.qwen3", "_EMBEDDING_INIT", "embedding init of untied models"),
    TitanName("torchtitan.models.qwen3", "_EMBEDDING_SKIP_INIT", "embedding init of tied models"),
    TitanName("torchtitan.models.qwen3", "_LINEAR_INIT", "lm_head init"),
    # The override registry exposes registration only through this dict (models/override_check.py).
    TitanName("torchtitan.config.override", "_REGISTRY", "look up an @override by its import name"),
    # FQNs from the Trainer.Config root, as torchtitan matches overrides (models/override_check.py).
    TitanName("torchtitan.config.configurable", "Configurable.Config.traverse", "override FQNs from the config root",
             parameter="_prefix"),
    # The checkpointer has no public hook after a save or a load (titan/trainer.py's HF save and digests).
    TitanName("torchtitan.components.checkpointer", "CheckpointManager._save", "save the model in HF safetensors after the last step's DCP save"),
    TitanName("torchtitan.components.checkpointer", "CheckpointManager._should_save", "whether a step saves at all"),
    TitanName("torchtitan.components.checkpointer", "CheckpointManager._load", "mark the load (start-up timings)"),
    TitanName("torchtitan.components.checkpointer", "CheckpointManager._find_load_step", "the step a resume loads"),
    TitanName("torchtitan.components.checkpointer", "CheckpointManager._create_checkpoint_id", "a step's folder"),
    # FSDP only where it shards or casts: one fp32 rank trains without it (models/native.py); after #4810 the
    # model class parallelizes itself (BaseModel.parallelize, which has skip_dp too).
    OneOf((TitanName("torchtitan.models.qwen3", "parallelize_qwen3", "", parameter="skip_dp"),
           TitanName("torchtitan.protocols.model", "BaseModel.parallelize", "", parameter="skip_dp")),
          "no FSDP at one fp32 rank"),
    # A router setting outside router_topk's contract (models/nki/overrides.py).
    TitanName("torchtitan.models.common.moe", "TokenChoiceTopKRouter.Config._debug_force_load_balance",
             "refuse a router the NKI kernel cannot run"),
)


# What patches.apply(target) replaces, checked with the rest for that target.
GLUE_INTERNALS = {
    "cpu": (
        TitanName("torch._utils", "_get_available_device_type", "answer 'cpu' as torchtitan's device"),
        TitanName("torch.distributed.fsdp._fully_shard._fsdp_collectives", "_get_gradient_divide_factors",
                 "plain SUM reductions on gloo"),
        TitanName("torchtitan.components.metrics", "build_device_memory_monitor", "CPU memory statistics"),
        TitanName("torchtitan.distributed.utils", "set_pg_timeouts", "a gloo barrier without device ids"),
        TitanName("torchtitan.models.common.decoder", "create_attention_mask", "CPU masks without the compiled search"),
        TitanName("torchtitan.models.common.attention", "FlexAttention._compiled_flex_attn",
                 "flex_attention compiled on first call (never called on CPU)"),
        TitanName("torchtitan.distributed.utils", "set_determinism", "its flex_attention compiled on first call"),
    ),
    "trn2": (TitanName("torchtitan.components.metrics", "build_device_memory_monitor",
                      "synchronize before memory statistics"),),
}


def internals_for(target: str) -> tuple:
    """Every name the pipeline uses on `target` (public, private, the target's glue)."""
    return PUBLIC_NAMES + TORCHTITAN_INTERNALS + GLUE_INTERNALS.get(target, ())


def used_on(name, variant: str) -> bool:
    return not name.apis or variant in name.apis


def _resolve(name: TitanName):
    obj, path = importlib.import_module(name.module), name.module
    for part in filter(None, name.name.split(".")):
        path = f"{path}.{part}"
        obj = getattr(obj, part) if hasattr(obj, part) or not inspect.ismodule(obj) else importlib.import_module(path)
    return obj


def missing_internals(names=TORCHTITAN_INTERNALS, variant: str | None = None) -> list[str]:
    """The names this torchtitan lacks of those used on its API (`variant`, default the installed one's)."""
    variant = variant or api.variant()
    missing = []
    for name in names:
        if used_on(name, variant) and (why := name.missing()) is not None:
            missing.append(name.qualname + ("" if why in ("absent", "no such keyword", "no such field", "none of them")
                                            else f" ({why})"))
    return missing


def table_rows(target: str, variant: str | None = None) -> list[tuple[str, str, str, str, str]]:
    """(name, kind, used on, why, found) for every name the pipeline uses on `target`, as doctor --titan prints them."""
    variant = variant or api.variant()
    rows = []
    for name in internals_for(target):
        on = "/".join(name.apis) or "all"
        if not used_on(name, variant):
            found = "not used on this API"
        elif (why := name.missing()) is not None:
            found = f"MISSING ({why})"
        else:
            found = name.found() if isinstance(name, (OneOf, RequiredFields)) else "present"
        rows.append((name.qualname, name.kind, on, name.why, found))
    return rows


def torchtitan_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return "not installed"


def check_torchtitan(target: str, internals=None) -> None:
    """Refuse, in one line, a torchtitan without the names this pipeline uses, in the launching process before
    any rank starts. Cheap on the (version, API) pairs they were read from (VERIFIED); any other torchtitan is
    imported and checked."""
    if internals is None:
        if (torchtitan_version(), api.variant()) in VERIFIED:
            return
        internals = internals_for(target)
    missing = missing_internals(internals)
    if missing:
        raise PipelineError(
            f"torchtitan {torchtitan_version()} lacks {len(missing)} name(s) this pipeline uses: "
            f"{', '.join(missing)} (written against torchtitan {WRITTEN_AGAINST}).",
            f"install torchtitan=={EXPECTED_TORCHTITAN} (requirements-dev.lock), or port pipeline/titan/ (accessors.py, "
            "patches.py, model_spec.py and internals.py's lists) to this version; `python -m pipeline doctor --titan` "
            "prints every name with what this torchtitan has.")
