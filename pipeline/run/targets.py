"""Where a run executes: detection, MFU peak and launch environment, one entry per target."""

from __future__ import annotations

import glob
import os
import shutil
from dataclasses import dataclass, field

from pipeline.errors import PipelineError
from pipeline.malloc import RETAIN_FREED_MEMORY


@dataclass(frozen=True)
class Trn2Node:
    """trn2.48xlarge, the node the trn2 target means; every trn2 hardware fact lives here. Sources
    (docs/sources.md): neuron:about-neuron/arch/neuron-hardware/trainium2.html (8 physical cores, 96 GiB
    HBM and 667 dense bf16 TFLOP/s per chip), neuron:general/arch/neuron-features/logical-neuroncore-config.html
    (LNC=2 is the runtime default when NEURON_LOGICAL_NC_CONFIG is unset), neuron:training/best-practices.html
    (16 chips; 64 ranks of ~24 GiB HBM at LNC=2).
    On CPU, tests/training/test_training_memory.py runs hbm_per_rank (24 GiB at LNC=2) and the trn2 dry
    runs peak_flops_per_rank."""

    chips: int = 16  # Trainium2 devices, /dev/neuron0..15
    efa_devices: int = 16  # EFA interfaces (multi-node collectives)
    hbm_per_chip: int = 96 * 2**30  # at LNC=2 a rank (a logical core) has a quarter: 24 GiB
    physical_cores_per_chip: int = 8
    default_lnc: int = 2  # the runtime's logical NeuronCore grouping when LNC_ENV is unset
    peak_bf16_per_chip: float = 667e12  # dense bf16 FLOP/s
    device_glob: str = "neuron[0-9]*"  # the devices under /dev

    # The Neuron runtime's own HBM: "a micro-code overhead of 96MB per physical Neuron Core" (Neuron 2.33 docs,
    # neuron-runtime/explore/device-memory): 192 MB for a rank at LNC=2. Its scratchpad, DMA rings and collective
    # buffers depend on the compiled graphs, and no public source gives a size for them: they stay in HEADROOM.
    microcode_per_physical_core: int = 96 * 2**20

    def hbm_per_rank(self, lnc: int) -> int:
        return self.hbm_per_chip * lnc // self.physical_cores_per_chip

    def runtime_reserve_per_rank(self, lnc: int) -> int:
        return self.microcode_per_physical_core * lnc

    def peak_flops_per_rank(self, lnc: int) -> float:
        return self.peak_bf16_per_chip * lnc / self.physical_cores_per_chip


TRN2 = Trn2Node()
LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"  # logical NeuronCore config: 1 or 2 physical cores per rank
# Dense bf16 peaks (no sparsity) of the GPUs this pipeline is checked on.
CUDA_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
# TorchNeuron's compiled-graph (NEFF) cache (neuron:torch/reference/env-vars.html; docs/sources.md).
# NEURON_COMPILE_CACHE_URL is the torch-xla-era variable: TorchNeuron does not read it, so a cache
# set through it is never reused and every run recompiles. One fixed directory on the host (and
# the same path, bind-mounted, in the image) is what makes a second run with the same shapes skip
# the compile.
NEFF_CACHE_ENV = "TORCH_NEURONX_NEFF_CACHE_DIR"
DEFAULT_NEFF_CACHE = "/var/tmp/neuron-compile-cache"


# What pipeline.malloc.RETAIN_FREED_MEMORY keeps is never given back, so it is set only for runs whose
# estimated need (pipeline.training.memory plus the processes, all ranks) is at most this fraction of
# the machine's memory: the embedded models, not real ones.
RETAIN_FREED_UP_TO = 0.25


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    env: dict = field(default_factory=dict)  # set for every launch on this target
    env_defaults: dict = field(default_factory=dict)  # set unless the caller's environment already sets them

    retain_freed_memory: bool = False  # glibc keeps freed memory (RETAIN_FREED_MEMORY) for runs that fit

    def launch_vars(self, environ: dict, need_bytes: int | None = None) -> dict:
        """The variables this target sets for a launch, resolved against the caller's environment;
        `need_bytes`: what the launch's ranks need together from this host (unknown: None)."""
        chosen = {**{k: environ.get(k, v) for k, v in self.env_defaults.items()}, **self.env}
        if self.retain_freed_memory and (need_bytes is None or need_bytes <= RETAIN_FREED_UP_TO * physical_memory_bytes()):
            chosen = {**RETAIN_FREED_MEMORY, **chosen}
        return chosen

    def launch_env(self, environ: dict, need_bytes: int | None = None) -> dict:
        return {**environ, **self.launch_vars(environ, need_bytes)}

    def peak_flops_per_rank(self, lnc: int = 2) -> float | None:
        if self.name == "trn2":
            return TRN2.peak_flops_per_rank(lnc)
        if self.name == "cuda":
            name = _cuda_device_name()
            return next((v for k, v in CUDA_PEAKS.items() if k in name), None)
        return None  # CPU: measured at start-up by each rank


def _cuda_device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    except Exception:  # noqa: BLE001 - no CUDA runtime at all is just "unknown"
        return ""


TARGETS = {
    "cpu": Target("cpu", "CPU with gloo (the embedded default; tests and CI)", retain_freed_memory=True),
    "cuda": Target("cuda", "NVIDIA GPUs with NCCL"),
    "trn2": Target("trn2", "trn2.48xlarge: 64 logical NeuronCores at LNC=2, TorchNeuron",
                   env={LNC_ENV: str(TRN2.default_lnc), "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"},
                   env_defaults={NEFF_CACHE_ENV: DEFAULT_NEFF_CACHE}),
}


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def neuron_devices() -> list[str]:
    return sorted(glob.glob(f"/dev/{TRN2.device_glob}"))


def detect() -> str:
    if neuron_devices():
        return "trn2"
    if shutil.which("nvidia-smi") and _cuda_device_name():
        return "cuda"
    return "cpu"


def resolve(name: str | None) -> Target:
    name = name or os.environ.get("TARGET") or detect()
    if name not in TARGETS:
        raise PipelineError(f"TARGET={name!r} is unknown; known targets: {', '.join(TARGETS)}.", "set TARGET to one of them.")
    return TARGETS[name]


def check_launchable(target: Target) -> None:
    """Refuse to launch on hardware that is not there (a dry run skips this)."""
    if target.name == "trn2" and not neuron_devices():
        raise PipelineError("TARGET=trn2 but this machine has no /dev/neuron* devices.",
                            "run on a trn2 instance, or use DRY_RUN=1 to only print the launch.")
    if target.name == "cuda" and not _cuda_device_name():
        raise PipelineError("TARGET=cuda but no CUDA device is visible.", "run on a GPU machine or use TARGET=cpu.")
