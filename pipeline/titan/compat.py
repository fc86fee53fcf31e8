"""Every torchtitan-version and CPU workaround, in one place.

`apply(target)` runs inside each torchrun rank before torchtitan is imported, and only for the
targets that need it. Nothing here edits site-packages; each item says why it exists so it can
be deleted when upstream (or torchtitan-neuron) no longer needs it. The CPU-only model overrides
(dense-mask attention, loop experts) are not patches: they go through torchtitan's override
registry, see `pipeline/models/cpu_overrides.py`.

Every private torchtitan name the pipeline uses is reached through this module only
(TORCHTITAN_INTERNALS lists them). `check_torchtitan()` runs in the launcher before any rank
starts: on a torchtitan without one of them (torchtitan-neuron "0.2.2+neuron.1" may be such a
one), one line names what is missing and the version it was written against.
"""

from __future__ import annotations

import importlib
import inspect
import resource
import shlex
import sys
from dataclasses import dataclass

from pipeline.errors import PipelineError
from pipeline.titan import api

_applied: set[str] = set()


def apply(target: str) -> None:
    if target in _applied or target not in _GLUE:
        return
    if "torchtitan" in sys.modules:
        raise RuntimeError(f"compat.apply({target!r}) must run before torchtitan is imported")
    for glue in _GLUE[target]:
        glue()
    _applied.add(target)


def _select_cpu_device() -> None:
    # torchtitan.tools.utils evaluates `_get_available_device_type() or "cuda"` at import
    # time, so a machine without an accelerator is treated as CUDA and fails in set_device.
    # Answering "cpu" makes torchtitan pick torch.cpu as device module and gloo as backend.
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"


class CpuMemoryMonitor:
    """Stands in for torchtitan's DeviceMemoryMonitor, which reads CUDA allocator stats.

    On CPU the honest figure is the process's peak resident set size (ru_maxrss); there is
    no allocator "reserved" pool, so active and reserved both report it.
    """

    device_name = "cpu"

    def __init__(self) -> None:
        import os

        self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_capacity_gib = self.device_capacity / 2**30

    @staticmethod
    def peak_rss_bytes() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        peak = self.peak_rss_bytes()
        gib, pct = peak / 2**30, 100 * peak / self.device_capacity
        return DeviceMemStats(gib, pct, gib, pct, 0, 0)

    def reset_peak_stats(self) -> None:
        # ru_maxrss cannot be reset: CPU memory is the peak since process start.
        pass


def _cpu_memory_monitor() -> None:
    import torchtitan.components.metrics as metrics

    metrics.build_device_memory_monitor = CpuMemoryMonitor


def _gloo_sum_reductions() -> None:
    # FSDP2 reduce-scatters gradients with ReduceOp.PREMUL_SUM(1/factor) (or AVG) and gloo
    # implements neither. torchtitan normalises the loss by the global token count and sets
    # the divide factor to 1, so a plain SUM is exactly the same reduction: force it, as
    # FSDP already does for MTIA.
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

    original = collectives._get_gradient_divide_factors

    def sum_only(rs_group, ar_group, reduce_dtype, device_type="", factor=None, _force=False):
        return original(rs_group, ar_group, reduce_dtype, device_type, factor, True)

    collectives._get_gradient_divide_factors = sum_only


def _cpu_barrier() -> None:
    # After step 1 torchtitan calls barrier(device_ids=[device_module.current_device()]);
    # torch.cpu.current_device() returns the string "cpu", which barrier rejects. Gloo
    # needs no device ids: same barrier, same timeout changes, without them.
    import torch.distributed as dist
    import torchtitan.distributed.utils as dist_utils

    def set_pg_timeouts(timeout, parallel_dims):
        dist.barrier()
        groups = [m.get_group() for m in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
        for group in groups:
            dist.set_timeout(timeout, group)

    dist_utils.set_pg_timeouts = set_pg_timeouts


def _cpu_attention_masks() -> None:
    # torchtitan builds each batch's mask with torch.compile(create_block_mask), even with compile
    # off: step 1 traces it and builds C++ with g++ (seconds of step 1; later steps re-run it) to
    # find block sparsity. On CPU every attention layer is pipeline.models.cpu_overrides'
    # DenseMaskAttention (FlexAttention has no CPU backward), which reads only the mask_mod. The
    # same mask_mod in a BlockMask whose every block is "partial" is exact for any consumer
    # (FlexAttention applies mask_mod inside partial blocks) and costs a few small tensors.
    import torchtitan.models.common.decoder as decoder

    decoder.create_attention_mask = all_partial_block_mask


def all_partial_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, **_):
    """create_block_mask's result without the sparsity search: every (q, kv) block partial."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    q_block, kv_block = BLOCK_SIZE if isinstance(BLOCK_SIZE, tuple) else (BLOCK_SIZE, BLOCK_SIZE)
    q_blocks, kv_blocks = -(-Q_LEN // q_block), -(-KV_LEN // kv_block)
    heads = H or 1
    num = torch.full((B or 1, heads, q_blocks), kv_blocks, dtype=torch.int32, device=device)
    indices = torch.arange(kv_blocks, dtype=torch.int32, device=device).expand(B or 1, heads, q_blocks, kv_blocks)
    return BlockMask.from_kv_blocks(num, indices.contiguous(), BLOCK_SIZE=(q_block, kv_block), mask_mod=mask_mod,
                                    seq_lengths=(Q_LEN, KV_LEN))


def apply_titan_args(config, args: list[str]):
    """torchtitan's own CLI flags (`--training.steps 5`) over a built Trainer.Config, parsed by the
    parser `torchtitan.train` uses (tyro with torchtitan's registry of custom rules). An unknown or
    ill-typed flag is a one-line PipelineError naming it (tyro's boxed report is kept out of sight)."""
    if not args:
        return config
    import contextlib
    import io

    import tyro
    from torchtitan.config.manager import ConfigManager, custom_registry

    ConfigManager()  # its __init__ registers torchtitan's rules (comma lists, override.imports) on the registry
    if "--help" in args or "-h" in args:  # TITAN_ARGS=--help: tyro prints every flag with its value here, exits 0
        tyro.cli(type(config), args=["--help"], default=config, registry=custom_registry, prog="TITAN_ARGS")

    def parse(strict: bool):
        report = io.StringIO()
        with contextlib.redirect_stdout(report), contextlib.redirect_stderr(report):
            try:
                return tyro.cli(type(config), args=list(args), default=config, registry=custom_registry,
                                prog="TITAN_ARGS", return_unknown_args=not strict), ""
            except SystemExit:
                return None, report.getvalue()

    parsed, report = parse(strict=False)
    if parsed is None:
        raise PipelineError(f"TITAN_ARGS {shlex.join(args)!r}: {_tyro_problem(report)}.", TITAN_ARGS_FIX)
    parsed, unknown = parsed
    if unknown:
        flags = [u for u in unknown if u.startswith("-")] or unknown
        hint = _tyro_suggestion(parse(strict=True)[1])
        raise PipelineError(f"TITAN_ARGS: torchtitan has no flag {', '.join(flags)}"
                            f"{f' (did you mean {hint}?)' if hint else ''}.", TITAN_ARGS_FIX)
    return parsed


TITAN_ARGS_FIX = "use torchtitan's --section.key flags (TITAN_ARGS=--help lists them), e.g. --training.steps 5."


def _report_lines(report: str) -> list[str]:
    """tyro's boxed console report as plain lines (box-drawing characters and rules removed)."""
    lines = []
    for line in report.splitlines():
        text = line.strip(" │╭╮╰╯─")
        if text and set(text) - set("─- "):
            lines.append(text)
    return lines


def _tyro_problem(report: str) -> str:
    lines = _report_lines(report)
    detail = next((line for line in lines[1:] if not line.startswith(("Argument helptext", "For full helptext"))), "")
    return detail or (lines[0] if lines else "torchtitan's parser refused it")


def _tyro_suggestion(report: str) -> str | None:
    lines = _report_lines(report)
    for number, line in enumerate(lines):
        if line.startswith(("Perhaps you meant", "Arguments similar to")) and number + 1 < len(lines):
            flag = lines[number + 1].split()[0]
            return flag if flag.startswith("--") else None
    return None


class SynchronizedMemoryMonitor:
    """torchtitan's DeviceMemoryMonitor with the device synchronized before every read or reset.

    TorchNeuron executes asynchronously: "call torch.neuron.synchronize() before you read any memory
    statistic" (torch/guides/memory-profiling-guide, shared/notes/neuron.md); read without it, the
    peak lags behind the step it is logged for.
    """

    def __init__(self, inner, synchronize) -> None:
        self._inner, self._synchronize = inner, synchronize

    def get_peak_stats(self):
        self._synchronize()
        return self._inner.get_peak_stats()

    def reset_peak_stats(self) -> None:
        self._synchronize()
        self._inner.reset_peak_stats()

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _neuron_memory_monitor() -> None:
    import torchtitan.components.metrics as metrics

    build = metrics.build_device_memory_monitor

    def synchronized_monitor():
        import torch

        return SynchronizedMemoryMonitor(build(), torch.neuron.synchronize)

    metrics.build_device_memory_monitor = synchronized_monitor


# What each target needs before torchtitan is imported (targets without an entry need nothing).
_GLUE = {
    "cpu": (_select_cpu_device, _cpu_memory_monitor, _gloo_sum_reductions, _cpu_barrier, _cpu_attention_masks),
    "trn2": (_neuron_memory_monitor,),
}


# ---- private torchtitan internals: the only place the pipeline names them ------------------------

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
    # The checkpointer has no public hook after a save or a load (titan/trainer.py's weights file).
    Internal("torchtitan.components.checkpointer", "CheckpointManager._save", "write the model weights after the last save"),
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


# What apply(target)'s glue patches, checked with the rest for that target.
GLUE_INTERNALS = {
    "cpu": (
        Internal("torch._utils", "_get_available_device_type", "answer 'cpu' as torchtitan's device"),
        Internal("torch.distributed.fsdp._fully_shard._fsdp_collectives", "_get_gradient_divide_factors",
                 "plain SUM reductions on gloo"),
        Internal("torchtitan.components.metrics", "build_device_memory_monitor", "CPU memory statistics"),
        Internal("torchtitan.distributed.utils", "set_pg_timeouts", "a gloo barrier without device ids"),
        Internal("torchtitan.models.common.decoder", "create_attention_mask", "CPU masks without the compiled search"),
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
    from pipeline.errors import PipelineError

    if internals is None:
        if (torchtitan_version(), api.variant()) in VERIFIED:
            return
        internals = internals_for(target)
    missing = missing_internals(internals)
    if missing:
        raise PipelineError(
            f"torchtitan {torchtitan_version()} lacks {len(missing)} internal(s) this pipeline uses: "
            f"{', '.join(missing)} (written against torchtitan {WRITTEN_AGAINST}).",
            f"install torchtitan=={EXPECTED_TORCHTITAN} (requirements-dev.lock), or port pipeline/titan/compat.py "
            "to this version.")


# Accessors: the pipeline's modules call these, never the private names themselves.

def qwen3_layers(**kwargs):
    from torchtitan.models import qwen3

    return qwen3._build_qwen3_layers(**kwargs)


def qwen3_moe_layers(**kwargs):
    from torchtitan.models import qwen3

    return qwen3._build_qwen3_moe_layers(**kwargs)


def qwen3_norm(dim: int):
    from torchtitan.models import qwen3

    return qwen3._qwen3_norm(dim)


def qwen3_eps() -> float:
    from torchtitan.models import qwen3

    return qwen3._EPS


def qwen3_inits(tied: bool) -> dict:
    """torchtitan's Qwen3 parameter inits: the embedding's (skipped when tied to the lm_head) and the lm_head's."""
    from torchtitan.models import qwen3

    return {"embedding": qwen3._EMBEDDING_SKIP_INIT if tied else qwen3._EMBEDDING_INIT, "lm_head": qwen3._LINEAR_INIT}


def registered_override(name: str):
    """The torchtitan Override registered under `module.function`, or None."""
    override = importlib.import_module("torchtitan.config.override")  # the module, not the decorator
    return override._REGISTRY.get(name)


def traverse(config, config_cls: type, prefix: str, recurse: bool = False):
    """config.traverse with FQNs rooted at `prefix` (as torchtitan's override matching sees them)."""
    return config.traverse(config_cls, recurse=recurse, _prefix=prefix)


def router_forces_load_balance(router_config) -> bool:
    return bool(router_config._debug_force_load_balance)


def checkpoint_manager_base():
    """torchtitan's CheckpointManager with public hooks, `before_save(step, last_step)`,
    `after_save(step, last_step)` and `after_load(step, loaded)`, plus `step_folder(step)`;
    titan/trainer.py subclasses this instead of overriding private methods."""
    global _HOOKED
    if _HOOKED is None:
        _HOOKED = _make_hooked_checkpoint_manager()
    return _HOOKED


_HOOKED = None


def _make_hooked_checkpoint_manager():
    from torchtitan.components.checkpointer import CheckpointManager

    class HookedCheckpointManager(CheckpointManager):
        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            pass

        def _save(self, curr_step: int, last_step: bool = False) -> bool:
            if not self._should_save(curr_step, last_step):
                return False
            self.before_save(curr_step, last_step)
            saved = super()._save(curr_step, last_step)
            if saved:
                self.after_save(curr_step, last_step)
            return saved

        def _load(self, step: int = -1) -> bool:
            loaded = super()._load(step)
            self.after_load(self._find_load_step() if step == -1 else step, loaded)
            return loaded

        def step_folder(self, step: int) -> str:
            return self._create_checkpoint_id(step)

        def before_save(self, step: int, last_step: bool) -> None:
            pass

        def after_save(self, step: int, last_step: bool) -> None:
            pass

        def after_load(self, step: int, loaded: bool) -> None:
            pass

    return HookedCheckpointManager
