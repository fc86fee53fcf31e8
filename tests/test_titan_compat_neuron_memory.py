"""titan/compat.py on trn2: memory statistics are read only after torch.neuron.synchronize()
(issue 12, finding 13; torch/guides/memory-profiling-guide in shared/notes/neuron.md)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from conftest import REPO
from pipeline.titan import compat

# A fresh interpreter (compat.apply must run before torchtitan is imported): a stand-in torch.neuron
# records synchronize(), a stand-in DeviceMemoryMonitor records each read; the monitor torchtitan's
# MetricsProcessor builds must synchronize before every read and reset.
PROBE = """
import types, torch
calls = []
torch.neuron = types.SimpleNamespace(synchronize=lambda: calls.append("synchronize"))
from pipeline.titan import compat
compat.apply("trn2")
import torchtitan.components.metrics as metrics

class Monitor:
    device_name, device_capacity_gib = "neuron (stand-in)", 24.0
    def __init__(self, *args): pass
    def get_peak_stats(self): calls.append("stats")
    def reset_peak_stats(self): calls.append("reset")

metrics.DeviceMemoryMonitor = Monitor
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
    monitor = compat.SynchronizedMemoryMonitor(inner, lambda: calls.append("sync"))
    assert monitor.get_peak_stats() == "peak" and monitor.device_name == "x"
    monitor.reset_peak_stats()
    assert calls == ["sync", "stats", "sync", "reset"]
