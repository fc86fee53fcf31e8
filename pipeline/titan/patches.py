"""CPU and trn2 runtime patches, applied inside each torchrun rank before torchtitan is imported.

`apply(target)` runs in each rank, and only for the targets that need it (_GLUE). Nothing here edits
site-packages; each item says why it exists so it can be deleted when upstream (or torchtitan-neuron)
no longer needs it. The CPU-only model overrides (dense-mask attention, loop experts) are not
patches: they go through torchtitan's override registry, see `pipeline/models/cpu_overrides.py`.

What each target's patches replace is listed in `pipeline.titan.internals` (GLUE_INTERNALS) and
checked with the rest before any rank starts. The torchtitan names replaced here are module
attributes without an underscore; the private names touched are torch's (torch._utils, FSDP2's
collectives). Private torchtitan names are reached only through `pipeline.titan.accessors`.
"""

from __future__ import annotations

import contextlib
import functools
import resource
import sys

_applied: set[str] = set()


def apply(target: str) -> None:
    if target in _applied or target not in _GLUE:
        return
    if "torchtitan" in sys.modules:
        raise RuntimeError(f"patches.apply({target!r}) must run before torchtitan is imported")
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


@contextlib.contextmanager
def _torch_compile_on_first_call():
    """While inside, torch.compile(fn, ...) answers a function that calls the real torch.compile on its
    first call: the same compiled function, made later, and only if it is ever called."""
    import torch

    real = torch.compile

    def compile_on_first_call(model=None, **options):
        if model is None:  # the decorator form: nothing to defer
            return real(**options)
        compiled = None

        @functools.wraps(model)
        def first_call_compiles(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = torch.compile(model, **options)
            return compiled(*args, **kwargs)

        return first_call_compiles

    torch.compile = compile_on_first_call
    try:
        yield
    finally:
        torch.compile = real


def _cpu_flex_compiled_on_first_call() -> None:
    # torchtitan compiles flex_attention in class FlexAttention's body, and set_determinism (our CPU runs
    # are deterministic) compiles it again without autotuning; torch.compile with options imports
    # inductor's compile_fx to check them: ~0.45 s of every rank's start (python -X importtime, 2 cores).
    # On CPU every attention layer is DenseMaskAttention (pipeline/models/cpu_overrides.py), so that
    # compiled function is never called: both make it on its first call instead.
    import torchtitan.distributed.utils as dist_utils

    with _torch_compile_on_first_call():
        import torchtitan.models.common.attention  # noqa: F401
    set_determinism = dist_utils.set_determinism

    @functools.wraps(set_determinism)
    def set_determinism_compiling_on_first_call(*args, **kwargs):
        with _torch_compile_on_first_call():
            return set_determinism(*args, **kwargs)

    dist_utils.set_determinism = set_determinism_compiling_on_first_call


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


class SynchronizedMemoryMonitor:
    """torchtitan's DeviceMemoryMonitor with the device synchronized before every read or reset.

    TorchNeuron executes asynchronously: "call torch.neuron.synchronize() before you read any memory
    statistic" (neuron:torch/guides/memory-profiling-guide.html, docs/sources.md); read without it, the
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
    "cpu": (_select_cpu_device, _cpu_memory_monitor, _gloo_sum_reductions, _cpu_barrier,
            _cpu_flex_compiled_on_first_call, _cpu_attention_masks),
    "trn2": (_neuron_memory_monitor,),
}
