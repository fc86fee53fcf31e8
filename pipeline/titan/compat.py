"""Every torchtitan-version and CPU workaround, in one place.

`apply(target)` runs inside each torchrun rank before torchtitan is imported, and only for the
targets that need it. Nothing here edits site-packages; each item says why it exists so it can
be deleted when upstream (or torchtitan-neuron) no longer needs it. The CPU-only model overrides
(dense-mask attention, loop experts) are not patches: they go through torchtitan's override
registry, see `pipeline/models/cpu_overrides.py`.
"""

from __future__ import annotations

import resource
import shlex
import sys

from pipeline.errors import PipelineError

_applied: set[str] = set()


def apply(target: str) -> None:
    if target != "cpu" or "cpu" in _applied:
        return
    if "torchtitan" in sys.modules:
        raise RuntimeError("titan_glue.apply('cpu') must run before torchtitan is imported")
    _select_cpu_device()
    _cpu_memory_monitor()
    _gloo_sum_reductions()
    _cpu_barrier()
    _applied.add("cpu")


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


# torchtitan 0.3.0's own text datasets (torchtitan/hf_datasets/text_datasets.py DATASETS) and the
# path each reads, named here so the launcher checks DATASET= without importing torchtitan;
# tests/test_titan_compat.py keeps this equal to the installed registry.
TITAN_DATASETS = {"c4": "allenai/c4", "c4_test": "tests/assets/c4_test", "c4_validation": "allenai/c4"}


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
