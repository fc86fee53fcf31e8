"""Crash and resume for real: kill -9 of the whole torchrun group mid-run, then the same command
again resumes from the last complete checkpoint with losses identical to an uninterrupted run.
Also: cut-short checkpoints are never taken as complete, and export onto a full disk fails
cleanly, leaving the previous export and the source checkpoint intact."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import REPO, read_metrics, run_pipeline
from pipeline import export as export_stage

STEPS = "8"  # checkpoint_interval 5 in configs/cpu.toml: step 5 is saved, the kill lands after it


def copy_model(checkpoints: Path, root: Path) -> Path:
    (root / "tiny").mkdir(parents=True)
    for part in ("hf", "data"):
        shutil.copytree(checkpoints / "tiny" / part, root / "tiny" / part)
    return root


def plant_incomplete_step(run_dir: Path, step: int) -> Path:
    """What a kill during a save leaves: DCP shard files, no .metadata, no weights file."""
    directory = run_dir / "checkpoint" / f"step-{step}"
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(b"\0" * 4096)
    (directory / f".{export_stage.WEIGHTS_FILE}.tmp").write_bytes(b"\0" * 64)
    return directory


def test_torchtitan_and_export_ignore_an_incomplete_step(tmp_path):
    from torchtitan.components.checkpoint import CheckpointManager

    run_dir = tmp_path / "run"
    complete = run_dir / "checkpoint" / "step-5"
    complete.mkdir(parents=True)
    (complete / ".metadata").write_bytes(b"x")
    (complete / export_stage.WEIGHTS_FILE).write_bytes(b"x")
    plant_incomplete_step(run_dir, 10)
    # torchtitan 0.3.0 counts a step only when step-N/.metadata exists (DCP renames it in last).
    find = CheckpointManager._find_load_step
    assert find(types.SimpleNamespace(folder=str(run_dir / "checkpoint"))) == 5
    step, path = export_stage.weights_file(run_dir)
    assert (step, path) == (5, complete / export_stage.WEIGHTS_FILE)
    # DCP finished step 10 but the kill came before its weights file: still not exported.
    (run_dir / "checkpoint" / "step-10" / ".metadata").write_bytes(b"x")
    assert export_stage.weights_file(run_dir)[0] == 5


def train_command(root: Path) -> tuple[list[str], dict]:
    env = {**os.environ, "PIPELINE_CHECKPOINTS": str(root), "MALLOC_MMAP_THRESHOLD_": "4294967296",
           "MALLOC_TRIM_THRESHOLD_": "4294967296"}
    return [sys.executable, "-m", "pipeline", "train", "--model", "tiny", "--path", "native", "--steps", STEPS], env


def kill_at_step(root: Path, kill_step: int) -> int:
    """Start the run in its own session and SIGKILL the whole group once step ≥ kill_step is logged."""
    command, env = train_command(root)
    metrics = root / "tiny" / "native" / "metrics.jsonl"
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
    reference = read_metrics(reference_root / "tiny" / "native")

    root = copy_model(checkpoints, tmp_path / "killed")
    kill_step = random.Random().randint(6, 7)
    seen = kill_at_step(root, kill_step)
    run_dir = root / "tiny" / "native"
    assert (run_dir / "checkpoint" / "step-5" / ".metadata").exists()
    assert not (run_dir / "checkpoint" / f"step-{STEPS}").exists(), "the kill landed after the last save"
    plant_incomplete_step(run_dir, 7)  # a save cut short must not be resumed from

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
    final = f"checkpoint/step-{STEPS}/{export_stage.WEIGHTS_FILE}"
    ours, theirs = load_file(str(run_dir / final)), load_file(str(reference_root / "tiny" / "native" / final))
    assert ours.keys() == theirs.keys() and all((ours[k] == theirs[k]).all() for k in ours)
    assert export_stage.weights_file(run_dir)[0] == int(STEPS)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_export_onto_a_full_disk_fails_cleanly(checkpoints, tmp_path):
    # The run lives on a small tmpfs that holds the source checkpoint and one bf16 export;
    # the fp32 export does not fit.
    root = tmp_path / "root"
    source_run = tmp_path / "source"
    copy_model(checkpoints, source_run)
    run_pipeline("train", "--model", "tiny", "--path", "native", "--steps", "0", "--fresh", root=source_run)
    shutil.copytree(source_run / "tiny", root / "tiny", ignore=shutil.ignore_patterns("native"))
    run_dir = root / "tiny" / "native"
    run_dir.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200m", "tmpfs", str(run_dir)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        shutil.copy(source_run / "tiny" / "native" / "run.json", run_dir / "run.json")
        step = run_dir / "checkpoint" / "step-0"
        step.mkdir(parents=True)
        for name in (".metadata", export_stage.WEIGHTS_FILE):
            shutil.copy(source_run / "tiny" / "native" / "checkpoint" / "step-0" / name, step / name)
        run_pipeline("export", "--model", "tiny", "--run", "native", root=root)
        before = {p: sha(p) for p in [*sorted((run_dir / "export").iterdir()), step / export_stage.WEIGHTS_FILE]}
        used = int(subprocess.run(["du", "-sk", str(run_dir)], capture_output=True, text=True).stdout.split()[0])
        subprocess.run(["mount", "-o", f"remount,size={used + 8 * 1024}k", str(run_dir)], check=True)

        result = run_pipeline("export", "--model", "tiny", "--run", "native", "--force", "--dtype", "fp32",
                              root=root, check=False)
        assert result.returncode == 2, result.stderr[-2000:]
        err = result.stderr.strip()
        assert "Traceback" not in result.stderr and "\n" not in err, err
        assert err.startswith("error:") and "full disk" in err and "Fix:" in err, err
        assert {p: sha(p) for p in before} == before
        export_stage.check_manifest(run_dir / "export")
        assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint", "export", "run.json"]
    finally:
        subprocess.run(["umount", str(run_dir)], check=False)
