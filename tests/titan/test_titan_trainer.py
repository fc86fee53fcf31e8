"""pipeline/titan/trainer.py: crash and resume for real. kill -9 of the whole torchrun group
mid-run, then the same command again resumes from the last complete checkpoint (torchtitan's
resume with the pipeline's weights file and metrics truncation) with losses identical to an
uninterrupted run; the run-directory lock left by the killed launch is taken over."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path


from pipeline.run import rundir
from pipeline.run.rundir import RunDir
from helpers import (REPO, copy_model, pipeline_env, plant_incomplete_step, read_metrics, run_dir as runs_dir, run_pipeline,
                     tensors)

STEPS = "8"  # checkpoint_interval 5 (TrainSettings, the CPU default): step 5 is saved, the kill lands after it


def train_command(root: Path) -> tuple[list[str], dict]:
    env = pipeline_env(root)
    return [sys.executable, "-m", "pipeline", "train", "--model", "tiny", "--path", "native", "--steps", STEPS], env


def kill_at_step(root: Path, kill_step: int) -> int:
    """Start the run in its own session and SIGKILL the whole group once step ≥ kill_step is logged."""
    command, env = train_command(root)
    metrics = runs_dir(root, "tiny", "native") / "metrics.jsonl"
    proc = subprocess.Popen(command + ["--fresh"], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    seen = 0
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists():
            seen = max((m["step"] for m in read_metrics(metrics.parent)), default=0)
            if seen >= kill_step:
                ranks = descendants(proc.pid)
                os.killpg(proc.pid, signal.SIGKILL)  # the ranks are in sessions of their own
                break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended on its own (status {proc.returncode}) before step {kill_step}"
    time.sleep(1)
    assert len(ranks) >= 3, f"expected torchrun and 2 ranks under the launch, found {ranks}"
    alive = [pid for pid, state in processes().items() if pid in ranks and state[0] != "Z"]
    assert alive == [], f"processes of the killed run are still running: {alive}"
    return seen


def processes() -> dict[int, tuple[str, int]]:
    """pid → (state, ppid) of every process (killed ones may stay zombies where PID 1 does not reap)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(stat.parent.name)] = (fields[0], int(fields[1]))
    return table


def descendants(pid: int) -> set[int]:
    table, found, frontier = processes(), set(), {pid}
    while frontier:
        frontier = {child for child, (_, parent) in table.items() if parent in frontier} - found
        found |= frontier
    return found


def test_kill_9_then_rerun_resumes_with_identical_losses(checkpoints, tmp_path):
    reference_root = copy_model(checkpoints, tmp_path / "reference")
    run_pipeline("train", "--model", "tiny", "--path", "native", "--steps", STEPS, "--fresh", root=reference_root)
    reference = read_metrics(runs_dir(reference_root, "tiny", "native"))

    root = copy_model(checkpoints, tmp_path / "killed")
    kill_step = random.Random().randint(6, 7)
    seen = kill_at_step(root, kill_step)
    run_dir = runs_dir(root, "tiny", "native")
    assert (run_dir / "checkpoint" / "step-5" / ".metadata").exists()
    assert not (run_dir / "checkpoint" / f"step-{STEPS}").exists(), "the kill landed after the last save"
    plant_incomplete_step(run_dir, 7)  # a save cut short must not be resumed from
    assert (run_dir / rundir.LOCK).exists()  # the killed launch's lock: its flock died with it

    command, env = train_command(root)  # the same command again, without --fresh
    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    logs = rerun.stdout + rerun.stderr
    assert f"Loading the checkpoint from {run_dir}/checkpoint/step-5" in logs, f"killed at step {seen}"
    assert "Training starts at step 6" in logs

    resumed = read_metrics(run_dir)
    assert [m["step"] for m in resumed] == list(range(1, int(STEPS) + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in reference], f"killed at step {seen}"
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in reference]
    final = f"checkpoint/step-{STEPS}/{rundir.HF_WEIGHTS}"
    ours, theirs = tensors(run_dir / final), tensors(runs_dir(reference_root, "tiny", "native") / final)
    assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)
    assert RunDir(run_dir).hf_weights()[0] == int(STEPS)

