"""pipeline/run/continuation.py: a re-run continues a run only with the settings it recorded (more
STEPS continues it), FRESH=1 checks the new run's data before it deletes anything and then moves
the old run aside in one rename, and a step is complete only with every rank's DCP shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.run import continuation
from pipeline.run.rundir import RunDir
from pipeline.run.spec import RunSpec
from helpers import c4_stand_in, cli, copy_model, recorded_run, resolved, run_dir as runs_dir
from tiny_checkpoint import ok, one_error_line


@pytest.fixture
def spec(tmp_path) -> RunSpec:
    return resolved(tmp_path)


def changed(spec: RunSpec, **settings) -> RunSpec:
    from dataclasses import replace

    other = RunSpec.from_dict(spec.to_dict())
    other.settings = replace(spec.settings, **settings)
    return other


def test_other_settings_are_refused_naming_the_keys_and_more_steps_continue(tmp_path, spec):
    run = recorded_run(tmp_path / "runs" / "native", spec)
    continuation.check_continues(run, changed(spec, steps=spec.settings.steps + 5))  # continue training
    with pytest.raises(PipelineError) as err:
        continuation.check_continues(run, changed(spec, dataset="other.jsonl", seq_len=64, steps=3))
    assert "dataset ('local' → 'other.jsonl')" in err.value.problem and "seq_len (128 → 64)" in err.value.problem
    assert "steps" not in err.value.problem.split("settings:")[1]
    assert "RUN_NAME=" in err.value.fix and "FRESH=1" in err.value.fix


def test_fewer_steps_than_the_checkpoints_hold_are_refused(tmp_path, spec):
    run = recorded_run(tmp_path / "runs" / "native", spec, steps_done=10)
    with pytest.raises(PipelineError, match="already at step 10; STEPS=3"):
        continuation.check_continues(run, changed(spec, steps=3))


def test_a_run_directory_without_progress_is_a_new_run(tmp_path, spec):
    run = RunDir(tmp_path / "runs" / "native")
    run.path.mkdir(parents=True)
    spec.run_dir = str(run.path)
    RunDir(Path(spec.run_dir)).save_spec(spec)  # a launch that failed before its first step
    continuation.check_continues(run, changed(spec, dataset="other.jsonl"))


def test_a_step_missing_a_ranks_shard_is_incomplete_and_removed_before_a_resume(tmp_path, spec):
    run = recorded_run(tmp_path / "runs" / "native", spec, steps_done=5)  # 2 ranks (configs/cpu.toml)
    assert spec.world_size == 2 and run.complete_steps() == [5]
    broken = run.step_dir(10)
    broken.mkdir()
    (broken / ".metadata").write_bytes(b"x")  # a deletion cut short left DCP's marker, one shard gone
    (broken / "__0_0.distcp").write_bytes(b"x")
    assert run.dcp_steps() == [5, 10] and run.complete_steps() == [5] and run.incomplete_steps() == [10]
    assert continuation.remove_incomplete_steps(run) == [10]
    assert sorted(p.name for p in run.checkpoint.iterdir()) == ["step-5"]


def test_discard_moves_the_run_aside_in_one_rename(tmp_path, spec, monkeypatch):
    import os

    run = recorded_run(tmp_path / "runs" / "native", spec)
    stale = tmp_path / "runs" / f"{continuation.DISCARDED_PREFIX}native-0123abcd"  # a discard killed before
    stale.mkdir()
    other = tmp_path / "runs" / f"{continuation.DISCARDED_PREFIX}native-x-0123abcd"  # run "native-x"'s: kept
    other.mkdir()
    renames = []
    real = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (renames.append((Path(a), Path(b))), real(a, b))[1])
    aside = continuation.discard(run)
    assert renames == [(run.path, aside)]
    assert (aside / "run.json").exists() and (aside / "checkpoint" / "step-2" / "__1_0.distcp").exists()
    assert run.path.is_dir() and list(run.path.iterdir()) == []
    assert not stale.exists() and other.exists()
    continuation.delete_discarded(run)
    assert not aside.exists() and other.exists()


def test_run_names_stay_inside_runs(tmp_path):
    from pipeline.run import store

    home = store.home("tiny", tmp_path)
    assert home.run("sft-chat.v2").path == tmp_path / "tiny" / "runs" / "sft-chat.v2"
    for bad in ("../x", ".hidden", "a/b", "", "x" * 101):
        with pytest.raises(PipelineError, match="is not a run name"):
            home.run(bad)


# ---- through the CLI ------------------------------------------------------------------------

def broken_after_the_first_lines(tmp_path: Path) -> Path:
    """Six good lines (more than the launcher's first look once read), then one the loader cannot parse."""
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(6)) + "{not json\n")
    return data


def _invalid_utf8_at_line_8(tmp_path: Path) -> Path:
    """datasets' json builder refuses it (ValueError: Invalid UTF-8); decoding with errors="replace" did not."""
    data = tmp_path / "mine.jsonl"
    lines = [json.dumps({"text": f"document {i} " * 20}).encode() for i in range(7)] + [b'{"text": "caf\xe9"}']
    data.write_bytes(b"\n".join(lines) + b"\n")
    return data


def _bad_role_at_line_11(tmp_path: Path) -> Path:
    data = tmp_path / "mine.jsonl"
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    rows = [{"messages": turns}] * 10 + [{"messages": [turns[0], {"role": "bot", "content": "Hello"}]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


@pytest.mark.parametrize("data, said", [
    (broken_after_the_first_lines, "mine.jsonl:7 is not JSON"),
    (_invalid_utf8_at_line_8, "mine.jsonl:8 is not UTF-8"),
    (_bad_role_at_line_11, "mine.jsonl:11 message 2 has no role among system, user, assistant"),
])
def test_fresh_with_data_the_ranks_cannot_read_deletes_nothing(checkpoints, tmp_path, data, said):
    root = copy_model(checkpoints, tmp_path / "root", link=True)
    spec = resolved(tmp_path)
    run = recorded_run(runs_dir(root, "tiny", "native"), spec)
    (run.path / "export").mkdir()
    (run.path / "verify.json").write_text('{"passed": true}\n')
    before = sorted(str(p.relative_to(run.path)) for p in run.path.rglob("*"))
    result = cli("train", "--model", "tiny", "--path", "native", "--steps", "1", "--nproc-per-node", "1",
                          "--fresh", "--dataset", str(data(tmp_path)), root=root)
    line = one_error_line(result)
    assert said in line
    assert "launching" not in result.stdout
    assert sorted(str(p.relative_to(run.path)) for p in run.path.rglob("*") if p.name != ".lock") == before
    assert json.loads(run.run_json.read_text())["settings"]["dataset"] == "local"


@pytest.mark.slow
def test_a_new_experiment_in_a_trained_run_is_refused_and_a_named_one_trains(checkpoints, tmp_path):
    """`make pipeline`, then `make train-native STEPS=3 DATASET=mydata.jsonl`: refused, nothing trained,
    run.json still the first run's; RUN_NAME=mine trains it beside the first, and export takes the name."""
    root = copy_model(checkpoints, tmp_path / "root", link=True)
    first = ("train", "--model", "tiny", "--path", "native", "--nproc-per-node", "1")
    ok(cli(*first, "--steps", "1", root=root))
    run = RunDir(runs_dir(root, "tiny", "native"))
    recorded = run.run_json.read_text()
    metrics = run.metrics.read_text()
    mine = tmp_path / "mydata.jsonl"
    mine.write_text("".join(json.dumps({"text": f"my document {i} " * 30}) + "\n" for i in range(8)))
    result = cli(*first, "--steps", "3", "--dataset", str(mine), root=root)
    line = one_error_line(result)
    assert "run 'native'" in line and "dataset ('local' → " in line and "RUN_NAME=" in line and "FRESH=1" in line
    assert "launching" not in result.stdout
    assert run.run_json.read_text() == recorded and run.metrics.read_text() == metrics
    ok(cli(*first, "--steps", "2", "--dataset", str(mine), "--name", "mine", root=root))
    named = RunDir(root / "tiny" / "runs" / "mine")
    assert json.loads(named.run_json.read_text())["run_dir"] == str(named.path)
    assert [r["step"] for r in named.metric_records()] == [1, 2]
    assert (named.path / "tb").is_dir()  # TensorBoard's events are the named run's
    ok(cli("export", "--model", "tiny", "--path", "native", "--name", "mine", root=root))
    assert (named.export / "config.json").exists() and not run.export.exists()
    ok(cli(*first, "--steps", "2", root=root))  # more STEPS, same settings: continues
    assert [r["step"] for r in run.metric_records()] == [1, 2]


def test_a_setting_added_since_the_run_was_recorded_reads_as_its_default(tmp_path, spec):
    run = recorded_run(tmp_path / "runs" / "native", spec)
    old = json.loads(run.run_json.read_text())
    del old["settings"]["eval_steps"], old["data_format"]  # as an older pipeline wrote run.json
    run.run_json.write_text(json.dumps(old))
    continuation.check_continues(run, spec)
    with pytest.raises(PipelineError, match=r"eval_steps \(4 → 9\)"):
        continuation.check_continues(run, changed(spec, eval_steps=9))


@pytest.mark.slow
def test_a_rank_that_cannot_read_the_data_stops_in_one_line(checkpoints, tmp_path):
    """Without FRESH nothing is deleted, so the launcher checks a staged set's files are there but does
    not hash them; a shard that is no gzip then fails the ranks' loader, and that is one line, not a
    traceback per rank."""
    root = copy_model(checkpoints, tmp_path / "root", link=True)
    mirror = c4_stand_in(tmp_path / "c4", shards=1)
    (mirror / "en" / "c4-train.00000-of-01024.json.gz").write_bytes(b"\x1f\x8b not a gzip stream")
    ok(cli("data", "--model", "tiny", "--dataset", "c4", "--mirror", str(mirror), "--shards", "1", root=root))
    result = cli("train", "--model", "tiny", "--path", "native", "--steps", "1", "--nproc-per-node", "2",
                          "--dataset", "c4", "--name", "broken", root=root)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "the ranks cannot open DATASET=c4" in line and "c4-train.00000" in line and "Fix:" in line
    # No rank's traceback (the data is opened before torchtitan's Trainer, whose error record torchrun
    # would print per rank); torchrun's own ChildFailedError summary is the one left.
    assert result.stderr.count("Traceback") <= 1 and "datasets/" not in result.stderr, result.stderr[-3000:]
