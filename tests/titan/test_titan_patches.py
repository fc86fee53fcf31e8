"""titan/patches.py: on trn2, memory statistics are read only after torch.neuron.synchronize()
(issue 12, finding 13; neuron:torch/guides/memory-profiling-guide.html, docs/sources.md); on CPU, torchtitan's
compiled flex_attention is made on its first call (issue 22, item 3)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from helpers import REPO
from pipeline.titan import patches

# A fresh interpreter (patches.apply must run before torchtitan is imported): a stand-in torch.neuron
# records synchronize(), a stand-in DeviceMemoryMonitor records each read; the monitor torchtitan's
# MetricsProcessor builds must synchronize before every read and reset.
STAND_IN_NEURON = """
import json, sys, types, torch
calls = []
torch.neuron = types.SimpleNamespace(synchronize=lambda: calls.append("synchronize"))
from pipeline.titan import patches
patches.apply("trn2")
import torchtitan.components.metrics as metrics

class Monitor:
    device_name, device_capacity_gib = "neuron (stand-in)", 24.0
    def __init__(self, *args): pass
    def get_peak_stats(self):
        calls.append("stats")
        return metrics.DeviceMemStats(0, 0, 3.0, 0, 0, 0)
    def reset_peak_stats(self): calls.append("reset")

metrics.DeviceMemoryMonitor = Monitor
"""
PROBE = STAND_IN_NEURON + """
monitor = metrics.build_device_memory_monitor()
monitor.get_peak_stats(); monitor.reset_peak_stats(); monitor.get_peak_stats()
print(calls, monitor.device_capacity_gib)
"""


def test_metrics_monitor_synchronizes_before_every_read():
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == \
        "['synchronize', 'stats', 'synchronize', 'reset', 'synchronize', 'stats'] 24.0"


def test_wrapper_order_and_passthrough():
    calls = []
    inner = SimpleNamespace(get_peak_stats=lambda: calls.append("stats") or "peak",
                            reset_peak_stats=lambda: calls.append("reset"), device_name="x")
    monitor = patches.SynchronizedMemoryMonitor(inner, lambda: calls.append("sync"))
    assert monitor.get_peak_stats() == "peak" and monitor.device_name == "x"
    monitor.reset_peak_stats()
    assert calls == ["sync", "stats", "sync", "reset"]


# memory.json's peak is read through that same monitor (issue 17, 3.1): the trainer's metrics
# processor reads it at every log and once more at the end, each read after synchronize(), and
# training.entry.record_memory writes what it read. A stand-in run spec on trn2 (one rank).
MEMORY_JSON_PROBE = STAND_IN_NEURON + """
from pipeline.checkpoint.embedded import EMBEDDED
from pipeline.checkpoint.arch import arch_from_config
from pipeline.run.settings import TrainSettings
from pipeline.run.spec import RunSpec
from pipeline.titan.trainer import JsonlMetricsProcessor
from pipeline.training import entry

processor = types.SimpleNamespace(device_memory_monitor=metrics.build_device_memory_monitor(), logged_peak_memory_gib=5.0)
calls.clear()
peak = JsonlMetricsProcessor.run_peak_memory_gib(processor)
spec = RunSpec(model="tiny", model_key="tiny", path="native", target="trn2", source_dir=".", run_dir=sys.argv[1],
               arch=arch_from_config(EMBEDDED["tiny"].config), settings=TrainSettings(),
               memory={"parts_gib": {"parameters": 2.0, "activations": 2.0}})
entry.record_memory(spec, 0, peak)
print(calls, json.loads(open(sys.argv[1] + "/memory.json").read())["peak_gib_per_rank"])
"""


def test_memory_json_reads_the_synchronized_monitor(tmp_path):
    result = subprocess.run([sys.executable, "-c", MEMORY_JSON_PROBE, str(tmp_path)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    # synchronized before the one read at the end; the larger peak a logged step read (5.0) is kept
    assert result.stdout.strip().splitlines()[-1] == "['synchronize', 'stats'] [5.0]"


# On CPU the compiled flex_attention torchtitan makes in FlexAttention's class body is made on its first
# call: importing torchtitan's attention does not import inductor, torch.compile is torch's own again
# afterwards, and the first call compiles (once) with the options torchtitan gave.
DEFERRED_COMPILE_PROBE = """
import sys, torch
real = torch.compile
from pipeline.titan import patches
patches.apply("cpu")
import torchtitan.models.common.decoder
from torchtitan.models.common.attention import FlexAttention
import torchtitan.distributed.utils as dist_utils
from torchtitan.config.configs import DebugConfig
from torchtitan.distributed.parallel_dims import ParallelDims
dims = ParallelDims(dp_shard=1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
dist_utils.set_determinism(dims, torch.device("cpu"), DebugConfig(deterministic=True, seed=0), distinct_seed_mesh_dims=["pp"])
print("compile_fx imported:", "torch._inductor.compile_fx" in sys.modules, "restored:", torch.compile is real)
compiled = []
torch.compile = lambda fn, **options: compiled.append(sorted(options["options"])) or (lambda *a, **k: ("ran", a))
print(FlexAttention._compiled_flex_attn(1, 2), FlexAttention._compiled_flex_attn(3), compiled)
"""


def test_cpu_ranks_compile_flex_attention_only_when_called():
    result = subprocess.run([sys.executable, "-c", DEFERRED_COMPILE_PROBE], cwd=REPO, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout.strip().splitlines()
    assert out[-2] == "compile_fx imported: False restored: True"
    assert out[-1].startswith("('ran', (1, 2)) ('ran', (3,)) [[") and out[-1].count("max_autotune") == 1
