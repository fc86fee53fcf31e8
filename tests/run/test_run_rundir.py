"""pipeline/run/rundir.py: a checkpoint cut short is never taken as complete, by torchtitan's resume
nor by the run directory's steps; export reads only a complete step that holds the weights file (a
run's last step), and says so when the run was cut short before writing one."""

from __future__ import annotations

import os
import types

from pipeline.run import rundir
from pipeline.run.rundir import RunDir

from helpers import plant_incomplete_step


def test_torchtitan_and_export_ignore_an_incomplete_step(tmp_path):
    from torchtitan.components.checkpointer import CheckpointManager

    run_dir = tmp_path / "run"
    complete = run_dir / "checkpoint" / "step-5"
    complete.mkdir(parents=True)
    (complete / ".metadata").write_bytes(b"x")
    (complete / "__0_0.distcp").write_bytes(b"x")
    (complete / rundir.HF_WEIGHTS).mkdir()
    plant_incomplete_step(run_dir, 10)
    # torchtitan (0.3.0 and main) counts a step only when step-N/.metadata exists (DCP renames it in
    # last); main reads the folder through a storage object (local files: os.path's calls).
    find = CheckpointManager._find_load_step
    storage = types.SimpleNamespace(isdir=os.path.isdir, isfile=os.path.isfile, listdir=os.listdir)
    assert find(types.SimpleNamespace(folder=str(run_dir / "checkpoint"), _storage=storage)) == 5
    run = RunDir(run_dir)
    assert run.hf_weights() == (5, complete / rundir.HF_WEIGHTS)
    # DCP finished step 10 but the kill came before its HF save was renamed into place: complete (a resume
    # starts there, and saves the model if 10 is the last step), not exportable.
    (run_dir / "checkpoint" / "step-10" / ".metadata").write_bytes(b"x")
    assert run.hf_weights()[0] == 5
    assert run.dcp_steps() == run.complete_steps() == [5, 10]
    assert run.exportable_steps() == [5] and run.latest_exportable_step() == 5


def test_a_run_cut_short_before_any_hf_save_is_named_so(tmp_path):
    import pytest

    from pipeline.errors import PipelineError

    step = tmp_path / "run" / "checkpoint" / "step-5"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"x")  # an intermediate checkpoint: DCP only
    (step / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(PipelineError, match="none holds hf/.*cut short") as err:
        RunDir(tmp_path / "run").hf_weights()
    assert "rerun the training command" in err.value.fix
    with pytest.raises(PipelineError, match="only a run's last step holds the model"):
        RunDir(tmp_path / "run").hf_weights(5)
