"""The private torchtitan internals the pipeline uses, listed once, and the check that they exist.

TORCHTITAN_INTERNALS lists every private torchtitan name the pipeline uses; the pipeline's modules
reach them only through `pipeline.titan.accessors` (the one other module that names them; the test
of this module checks that no other does). GLUE_INTERNALS lists what `pipeline.titan.patches`
replaces for each target. `check_torchtitan()` runs in the launcher before any rank starts: on a
torchtitan without one of them (torchtitan-neuron "0.2.2+neuron.1" may be such a one), one line
names what is missing and the version it was written against.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from pipeline.errors import PipelineError
from pipeline.titan import api

# The torchtitan these internals were read from: the dev lock's 0.3.0, and upstream main of 2026-08-21
# (shared/wheels; the nearest public snapshot of torchtitan-neuron's base), where they all exist too. The
# image's torchtitan-neuron must have them, which check_torchtitan() verifies before anything is launched.
EXPECTED_TORCHTITAN = "0.3.0"
WRITTEN_AGAINST = "0.3.0 and upstream main of 2026-08-21"
# (version, API) pairs the test suite checks every internal on (the fast tier and the upstream-main tier):
# the launcher skips importing torchtitan for them. upstream main says 0.2.2 with the main API; PyPI's own
# 0.2.2 has the old one, and torchtitan-neuron ("0.2.2+neuron.1") is always checked.
VERIFIED = {(EXPECTED_TORCHTITAN, api.V030), ("0.2.2", api.MAIN)}


@dataclass(frozen=True)
class Internal:
    module: str
    name: str  # attribute path inside the module ("Class.method")
    why: str
    parameter: str | None = None  # a keyword the callable must accept

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}" + (f"({self.parameter}=)" if self.parameter else "")


TORCHTITAN_INTERNALS = (
    # torchtitan ships Qwen3 only as named flavors; these builders make layers with a checkpoint's own
    # shapes and keep torchtitan's layer and init conventions (models/native.py).
    Internal("torchtitan.models.qwen3", "_build_qwen3_layers", "dense Qwen3 layers from config.json"),
    Internal("torchtitan.models.qwen3", "_build_qwen3_moe_layers", "MoE Qwen3 layers from config.json"),
    Internal("torchtitan.models.qwen3", "_qwen3_norm", "Qwen3's RMSNorm config"),
    Internal("torchtitan.models.qwen3", "_EPS", "Qwen3's RMSNorm eps (checked against config.json)"),
    Internal("torchtitan.models.qwen3", "_EMBEDDING_INIT", "embedding init of untied models"),
    Internal("torchtitan.models.qwen3", "_EMBEDDING_SKIP_INIT", "embedding init of tied models"),
    Internal("torchtitan.models.qwen3", "_LINEAR_INIT", "lm_head init"),
    # The override registry exposes registration only through this dict (models/override_check.py).
    Internal("torchtitan.config.override", "_REGISTRY", "look up an @override by its import name"),
    # FQNs from the Trainer.Config root, as torchtitan matches overrides (models/override_check.py).
    Internal("torchtitan.config.configurable", "Configurable.Config.traverse", "override FQNs from the config root",
             parameter="_prefix"),
    # The checkpointer has no public hook after a save or a load (titan/trainer.py's HF save and digests).
    Internal("torchtitan.components.checkpointer", "CheckpointManager._save", "save the model in HF safetensors after the last step's DCP save"),
    Internal("torchtitan.components.checkpointer", "CheckpointManager._should_save", "whether a step saves at all"),
    Internal("torchtitan.components.checkpointer", "CheckpointManager._load", "mark the load (start-up timings)"),
    Internal("torchtitan.components.checkpointer", "CheckpointManager._find_load_step", "the step a resume loads"),
    Internal("torchtitan.components.checkpointer", "CheckpointManager._create_checkpoint_id", "a step's folder"),
    # FSDP only where it shards or casts: one fp32 rank trains without it (models/native.py).
    Internal("torchtitan.models.qwen3", "parallelize_qwen3", "no FSDP at one fp32 rank", parameter="skip_dp"),
    # A router setting outside router_topk's contract (models/nki/overrides.py).
    Internal("torchtitan.models.common.moe", "TokenChoiceTopKRouter.Config._debug_force_load_balance",
             "refuse a router the NKI kernel cannot run"),
)


# What patches.apply(target) replaces, checked with the rest for that target.
GLUE_INTERNALS = {
    "cpu": (
        Internal("torch._utils", "_get_available_device_type", "answer 'cpu' as torchtitan's device"),
        Internal("torch.distributed.fsdp._fully_shard._fsdp_collectives", "_get_gradient_divide_factors",
                 "plain SUM reductions on gloo"),
        Internal("torchtitan.components.metrics", "build_device_memory_monitor", "CPU memory statistics"),
        Internal("torchtitan.distributed.utils", "set_pg_timeouts", "a gloo barrier without device ids"),
        Internal("torchtitan.models.common.decoder", "create_attention_mask", "CPU masks without the compiled search"),
        Internal("torchtitan.models.common.attention", "FlexAttention._compiled_flex_attn",
                 "flex_attention compiled on first call (never called on CPU)"),
        Internal("torchtitan.distributed.utils", "set_determinism", "its flex_attention compiled on first call"),
    ),
    "trn2": (Internal("torchtitan.components.metrics", "build_device_memory_monitor",
                      "synchronize before memory statistics"),),
}


def internals_for(target: str) -> tuple[Internal, ...]:
    return TORCHTITAN_INTERNALS + GLUE_INTERNALS.get(target, ())


def _resolve(internal: Internal):
    obj = importlib.import_module(internal.module)
    for part in internal.name.split("."):
        obj = getattr(obj, part)
    return obj


def missing_internals(internals=TORCHTITAN_INTERNALS) -> list[str]:
    """The internals this torchtitan lacks (a module that cannot be imported counts as lacking)."""
    missing = []
    for internal in internals:
        try:
            obj = _resolve(internal)
            if internal.parameter and internal.parameter not in inspect.signature(obj).parameters:
                missing.append(internal.qualname)
        except (ImportError, AttributeError):
            missing.append(internal.qualname)
        except Exception as err:  # noqa: BLE001 - a module failing on import is a missing internal too
            missing.append(f"{internal.qualname} (import failed: {type(err).__name__})")
    return missing


def torchtitan_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return "not installed"


def check_torchtitan(target: str, internals=None) -> None:
    """Refuse, in one line, a torchtitan without the internals this pipeline uses, in the launching
    process before any rank starts. Cheap on the (version, API) pairs they were read from (VERIFIED);
    any other torchtitan is imported and checked."""
    if internals is None:
        if (torchtitan_version(), api.variant()) in VERIFIED:
            return
        internals = internals_for(target)
    missing = missing_internals(internals)
    if missing:
        raise PipelineError(
            f"torchtitan {torchtitan_version()} lacks {len(missing)} internal(s) this pipeline uses: "
            f"{', '.join(missing)} (written against torchtitan {WRITTEN_AGAINST}).",
            f"install torchtitan=={EXPECTED_TORCHTITAN} (requirements-dev.lock), or port pipeline/titan/accessors.py "
            "and patches.py (and internals.py's list) to this version.")
