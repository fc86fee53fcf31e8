"""Check pipeline.training.memory's estimate against peak memory measured on CPU runs.

For tiny and tiny-moe (native path, the CPU config: 2 gloo ranks, FSDP, float32, seq 128 × batch 2,
no activation checkpointing) it trains STEPS steps and compares, per rank, the estimate with the
measured training footprint: peak RSS minus the RSS right after the trainer was built, plus the
parameters that were already allocated then. CPU RSS also holds what the estimate leaves out on
purpose (the HF checkpoint read at start, allocator caching), so expect the measurement above it.
Usage: .venv/bin/python -m bench.memory_estimate [steps]   (outputs under $PIPELINE_CHECKPOINTS)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.run import targets
from pipeline.run.rundir import RunDir
from pipeline.launch import torchrun
from pipeline.training import memory
from pipeline.training.resolve import RunRequest, resolve

REPO = Path(__file__).resolve().parent.parent

GIB = 2**30


def measure(model: str, steps: int) -> dict:
    spec = resolve(RunRequest(model=model, path="native", target="cpu", flags={"steps": steps}))
    Path(spec.run_dir).mkdir(parents=True, exist_ok=True)
    for old in Path(spec.run_dir).iterdir():
        subprocess.run(["rm", "-rf", str(old)], check=True)
    RunDir(Path(spec.run_dir)).save_spec(spec)
    command = [part if part != torchrun.ENTRY_MODULE else "memory_rank" for part in torchrun.command(spec)]
    env = {**targets.TARGETS["cpu"].launch_env(dict(os.environ)),
           "PYTHONPATH": f"{REPO / 'bench'}{os.pathsep}{REPO}"}
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks = [json.loads(p.read_text()) for p in sorted(Path(spec.run_dir).glob("memory-rank*.json"))]
    measured = max(r["rss_peak"] - r["rss_built"] + r["params_bytes"] for r in ranks)
    estimate = memory.estimate(spec.arch, spec.settings, spec.path, spec.target)
    return {"model": model, "estimate_gib": estimate.total / GIB, "measured_gib": measured / GIB,
            "ratio": estimate.total / measured, "parts_gib": estimate.to_dict()["parts_gib"],
            "peak_rss_gib": max(r["rss_peak"] for r in ranks) / GIB}


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    for model in ("tiny", "tiny-moe"):
        print(json.dumps(measure(model, steps)), flush=True)
