"""pipeline/run/ref.py: the run address (MODEL, TRAIN_PATH, RUN_NAME) and the folder it names; the
request dataclasses take its fields instead of declaring their own."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline import flags
from pipeline.errors import PipelineError
from pipeline.run.ref import RunRef


def test_the_run_dir_is_runs_name_defaulting_to_the_path(tmp_path):
    assert RunRef("tiny", "native").run_dir(tmp_path).path == tmp_path / "tiny" / "runs" / "native"
    assert RunRef("tiny", "native", "sft").run_dir(tmp_path).path == tmp_path / "tiny" / "runs" / "sft"
    assert RunRef("Qwen/Qwen3-0.6B", "hf", "r1").run_dir(tmp_path).path == tmp_path / "Qwen--Qwen3-0.6B" / "runs" / "r1"
    with pytest.raises(PipelineError, match="is not a run name"):
        RunRef("tiny", "native", "../elsewhere").run_dir(tmp_path)


def test_the_requests_take_the_address_from_runref():
    from pipeline.launch.cluster import LaunchRequest
    from pipeline.training.resolve import RunRequest

    address = [f.name for f in flags.flag_fields(RunRef)]
    assert address == ["model", "path", "name"]
    assert issubclass(RunRequest, RunRef) and [f.name for f in dataclasses.fields(RunRequest)][:3] == address
    launch_fields = {f.name: f for f in dataclasses.fields(LaunchRequest)}
    assert launch_fields["run"].type == "RunRequest" and not set(address) & set(launch_fields)
