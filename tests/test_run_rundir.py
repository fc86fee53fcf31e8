"""pipeline/run/rundir.py: a checkpoint cut short is never taken as complete, by torchtitan's resume
nor by the run directory's latest complete step (what export reads)."""

from __future__ import annotations

import types
from pathlib import Path

from pipeline.run import rundir
from pipeline.run.rundir import RunDir


def plant_incomplete_step(run_dir: Path, step: int) -> Path:
    """What a kill during a save leaves: DCP shard files, no .metadata, no weights file."""
    directory = run_dir / "checkpoint" / f"step-{step}"
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(b"\0" * 4096)
    (directory / f".{rundir.WEIGHTS}.tmp").write_bytes(b"\0" * 64)
    return directory


def test_torchtitan_and_export_ignore_an_incomplete_step(tmp_path):
    from torchtitan.components.checkpoint import CheckpointManager

    run_dir = tmp_path / "run"
    complete = run_dir / "checkpoint" / "step-5"
    complete.mkdir(parents=True)
    (complete / ".metadata").write_bytes(b"x")
    (complete / rundir.WEIGHTS).write_bytes(b"x")
    plant_incomplete_step(run_dir, 10)
    # torchtitan 0.3.0 counts a step only when step-N/.metadata exists (DCP renames it in last).
    find = CheckpointManager._find_load_step
    assert find(types.SimpleNamespace(folder=str(run_dir / "checkpoint"))) == 5
    run = RunDir(run_dir)
    assert run.weights_file() == (5, complete / rundir.WEIGHTS)
    # DCP finished step 10 but the kill came before its weights file: still not exported.
    (run_dir / "checkpoint" / "step-10" / ".metadata").write_bytes(b"x")
    assert run.weights_file()[0] == 5
    assert run.dcp_steps() == [5, 10] and run.latest_complete_step() == 5
