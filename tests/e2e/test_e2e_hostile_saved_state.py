"""Hostile and careless edits of what a run saved, and of where it lives (issue 28, second pass): the
saved weights, metrics.jsonl, TITAN_ARGS paths, the DCP digests, the memory and disk a run needs, a
moved clone. Each is refused in one `error: … Fix: …` line with exit status 2 (or, for what a kill
leaves, handled with one warning), with the harness of test_e2e_hostile_inputs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import helpers
from helpers import copy_model, fake_run, hf_shard, run_dir as runs_dir
from pipeline.checkpoint import manifest
from pipeline.run import rundir
from test_e2e_hostile_inputs import cli, one_error_line, snapshot, world  # noqa: F401 - the fixture


# ---- item 4: export and verify check the saved weights against the hashes their ranks recorded --------

def _linked_export(export_runs: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(root, run): tiny's step-0 HF save (float32) in a root of its own, exported linked and verified."""
    root = copy_model(export_runs, tmp_path / "root", link=True)
    runs = root / "tiny" / "runs"
    runs.mkdir()
    run = fake_run(export_runs, runs).rename(runs / "native")
    spec = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**spec, "run_dir": str(run)}))
    for stage in (("export", "--dtype", "float32"), ("verify",)):
        result = cli(stage[0], "--model", "tiny", "--path", "native", *stage[1:], root=root, bounded=False)
        assert result.returncode == 0, result.stderr[-3000:]
    return root, run


def _scale_in_place(shard: Path, key: str, factor: float) -> None:
    """`key` (float32) scaled, written into the file's own bytes (the inode export linked, not a new file)."""
    import struct

    import numpy

    with open(shard, "r+b") as handle:
        size = struct.unpack("<Q", handle.read(8))[0]
        entry = json.loads(handle.read(size))[key]
        assert entry["dtype"] == "F32"
        start, end = (8 + size + offset for offset in entry["data_offsets"])
        handle.seek(start)
        values = numpy.frombuffer(handle.read(end - start), dtype="<f4") * numpy.float32(factor)
        handle.seek(start)
        handle.write(values.astype("<f4").tobytes())


@pytest.mark.slow  # export_runs trains (shared by the export and verify tests)
def test_an_edit_of_a_linked_export_shard_fails_publish_and_verify(export_runs, tmp_path):
    root, run = _linked_export(export_runs, tmp_path)
    saved = hf_shard(run)
    shard = run / "export" / saved.name
    assert shard.stat().st_ino == saved.stat().st_ino  # linked: the export's shard is the run's save
    _scale_in_place(shard, "model.norm.weight", 1.5)
    listed = json.loads((run / "export" / manifest.MANIFEST).read_text())
    listed["files"][shard.name]["sha256"] = manifest.sha256(shard)  # the careful forger: manifest rewritten
    (run / "export" / manifest.MANIFEST).write_text(json.dumps(listed))
    assert listed["verify"]["passed"] is True  # the verdict of before the edit
    one_error_line(cli("publish", "--model", "tiny", "--path", "native", "--repo", "team/tiny", "--dry-run", root=root),
                   str(shard), "not a shard the run's ranks saved")
    one_error_line(cli("verify", "--model", "tiny", "--path", "native", root=root, bounded=False), "verify failed")
    written = json.loads((run / "verify.json").read_text())
    weights = next(check for check in written["checks"] if check["name"] == "weights")
    assert written["passed"] is False and not weights["passed"]
    assert f"{saved} differs from the sha256 its rank recorded" in weights["detail"]


@pytest.mark.slow  # export_runs trains (shared by the export and verify tests)
def test_a_bit_flipped_in_the_saved_weights_fails_export_force(export_runs, tmp_path):
    root, run = _linked_export(export_runs, tmp_path)
    saved = hf_shard(run)
    os.unlink(run / "export" / saved.name)  # the export keeps its own copy: what it was stays intact
    shutil.copy2(saved, run / "export" / saved.name)
    before = snapshot(run / "export")
    with open(saved, "r+b") as handle:  # the lowest mantissa bit of the last float: finite, barely changed
        handle.seek(-4, os.SEEK_END)
        byte = handle.read(1)[0]
        handle.seek(-4, os.SEEK_END)
        handle.write(bytes([byte ^ 1]))
    for dtype in ("float32", "bfloat16"):  # linked and cast both read the save
        result = cli("export", "--model", "tiny", "--path", "native", "--dtype", dtype, "--force", root=root)
        one_error_line(result, f"{saved} differs from the sha256 its rank recorded", "saves the model again")
    assert snapshot(run / "export") == before
    manifest.check(run / "export")


def test_a_save_without_its_recorded_hashes_is_not_exported(export_runs, tmp_path):
    run = fake_run(export_runs, tmp_path)
    (rundir.RunDir(run).step_dir(0) / rundir.HF_WEIGHTS / rundir.HF_HASHES).unlink()
    from pipeline.errors import PipelineError
    from pipeline.outputs import export as export_stage

    with pytest.raises(PipelineError, match=r"\.sha256\.json does not exist"):
        export_stage.export(export_stage.ExportConfig(rundir.RunDir(run), dtype="float32"))
    assert not (run / "export").exists()


# ---- item 8: a torn last line of metrics.jsonl (a kill mid-write) does not block the resume ------------

@pytest.fixture(scope="module")
def trained_root(checkpoints, tmp_path_factory) -> Path:
    """A root of this module's own holding tiny's native run trained 2 steps on one rank (its last step
    saved), for the tests that continue it: each continues a copy."""
    root = copy_model(checkpoints, tmp_path_factory.mktemp("trained") / "checkpoints", link=True)
    helpers.run_pipeline("train", "--model", "tiny", "--path", "native", "--steps", "2", "--nproc-per-node", "1",
                         root=root)
    return root


def test_a_torn_metrics_tail_is_dropped_once_with_a_warning(tmp_path):
    run = rundir.RunDir(tmp_path / "run")
    run.path.mkdir()
    whole = [json.dumps({"step": 1, "loss": 2.5}), json.dumps({"step": 2, "loss": 2.25})]
    torn = '{"step": 3, "loss": 2.'
    run.metrics.write_text("\n".join(whole) + "\n" + torn)
    warning = run.drop_torn_metrics_tail()
    assert warning.startswith("warning: the last line of") and f"cut short ({len(torn)} bytes" in warning
    assert run.metrics.read_text() == "".join(line + "\n" for line in whole)
    assert run.drop_torn_metrics_tail() is None and run.metrics.read_text() == "".join(line + "\n" for line in whole)
    run.metrics.write_text(whole[0])  # a whole record the kill left without its newline: kept, terminated
    assert run.drop_torn_metrics_tail() is None and run.metrics.read_text() == whole[0] + "\n"
    run.metrics.write_text('{"st')  # a torn first line: the file empties
    assert run.drop_torn_metrics_tail() is not None and run.metrics.read_text() == ""
    assert [run.metric_step(line) for line in ('{"step": 4}', '{"step": 4, "lo', "[4]", '{"step": true}')] == \
        [4, None, None, None]


def test_a_resume_after_a_kill_mid_metrics_line_continues(trained_root):
    runs = trained_root / "tiny" / "runs"
    shutil.copytree(runs / "native", runs / "torn")
    with open(runs / "torn" / rundir.METRICS, "a") as handle:
        handle.write('{"step": 3, "loss": 11.9, "grad_n')  # a kill mid-write: no newline, no closing brace
    result = cli("train", "--model", "tiny", "--path", "native", "--name", "torn", "--steps", "3",
                 "--nproc-per-node", "1", root=trained_root, bounded=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (result.stdout + result.stderr).count("was cut short") == 1, result.stderr[-3000:]
    lines = (runs / "torn" / rundir.METRICS).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert lines[:2] == (runs / "native" / rundir.METRICS).read_text().splitlines()  # resumed at step 2


# ---- item 13: a moved clone (or checkpoints root) continues its runs ------------------------------------

def test_a_moved_checkpoints_root_continues_its_run(trained_root, tmp_path):
    moved = tmp_path / "moved" / "checkpoints"
    shutil.copytree(trained_root, moved, symlinks=True)  # as `mv` leaves it: the links inside are links still
    recorded = json.loads((runs_dir(moved, "tiny", "native") / rundir.RUN_JSON).read_text())
    assert recorded["data_file"].startswith(str(trained_root))  # what the old check compared, absolute
    other = tmp_path / "other.jsonl"
    other.write_text((moved / "tiny" / "data" / "train.jsonl").read_text())
    refused = cli("train", "--model", "tiny", "--path", "native", "--steps", "3", "--nproc-per-node", "1",
                  "--dataset", str(other), root=moved)
    one_error_line(refused, "trained with other settings: data_file", "dataset")  # another file is another run
    result = cli("train", "--model", "tiny", "--path", "native", "--steps", "3", "--nproc-per-node", "1",
                 root=moved, bounded=False)
    assert result.returncode == 0, result.stderr[-3000:]
    run = runs_dir(moved, "tiny", "native")
    lines = (run / rundir.METRICS).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    assert lines[:2] == (runs_dir(trained_root, "tiny", "native") / rundir.METRICS).read_text().splitlines()  # resumed
    assert json.loads((run / rundir.RUN_JSON).read_text())["source_dir"] == str(moved / "tiny" / "source")


# ---- item 7: TITAN_ARGS that would move the run's own files are refused --------------------------------

@pytest.mark.parametrize("flag", ["--metrics.jsonl-path {out}/metrics.jsonl", "--run-dir {out}",
                                  "--metrics.save-tb-folder {out}/tb", "--comm.save-traces-folder {out}/traces",
                                  "--profiler.save-memory-snapshot-folder ../elsewhere"])
def test_titan_args_moving_the_runs_files_are_refused(world, flag):
    given = flag.format(out=world.outside)
    result = cli("train", "--model", "tiny", "--path", "native", "--dry-run", f"--titan-args={given}", root=world.root)
    one_error_line(result, "a path option", "in its run directory", "Fix: drop the flag")
    world.unchanged()


def test_every_path_option_of_the_installed_torchtitan_is_known(tmp_path):
    """path_fields reads the config's dataclasses: the options the issue named and the ones it did not."""
    from pipeline.training import entry, titan_flags
    from test_e2e_hostile_inputs import _tiny_spec

    fields = set(titan_flags.path_fields(entry.build_config(_tiny_spec(tmp_path / "root"))))
    assert {"metrics.jsonl_path", "run_dir", "metrics.save_tb_folder", "comm.save_traces_folder", "dump_folder",
            "checkpoint.folder"} <= fields
    assert "training.steps" not in fields and not any(name.endswith("_freq") for name in fields)


# ---- item 5: the DCP digests are keyed with a per-user key kept outside the checkpoints root -----------

class _Payload:
    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def test_a_planted_pickle_with_its_digest_rewritten_is_refused_before_any_unpickling(trained_root, tmp_path):
    """The forger writes the run directory, not the key: a sha256 (the old, unkeyed digest) or an HMAC
    under a key of their own passes nothing, and nothing is unpickled."""
    import hashlib
    import hmac
    import pickle

    runs = trained_root / "tiny" / "runs"
    shutil.copytree(runs / "native", runs / "planted")
    run = rundir.RunDir(runs / "planted")
    canary = tmp_path / "pwned"
    planted = pickle.dumps(_Payload(canary))
    (run.step_dir(2) / rundir.DCP_METADATA).write_bytes(planted)
    for forged in (hashlib.sha256(planted).hexdigest(),
                   hmac.new(b"\0" * 32, b"dcp-metadata step-2\0" + planted, "sha256").hexdigest()):
        run.dcp_digests.write_text(json.dumps({"2": forged}))
        result = cli("train", "--model", "tiny", "--path", "native", "--name", "planted", "--steps", "3",
                     "--nproc-per-node", "1", root=trained_root, bounded=False)
        one_error_line(result, f"{run.step_dir(2)}/.metadata is not the one this pipeline saved", "differs from the digest")
        assert "launching" not in result.stdout and not canary.exists()


def test_the_digest_key_is_made_once_0600_outside_the_root_and_checked(tmp_path, monkeypatch):
    from pipeline import envvars
    from pipeline.errors import PipelineError
    from pipeline.run import digest_key

    monkeypatch.delenv(envvars.DIGEST_KEY)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    root = tmp_path / "checkpoints"
    key = tmp_path / "config" / "qwen3-pipeline" / "dcp-digest.key"
    assert digest_key.key_path() == key
    with pytest.raises(PipelineError, match="does not exist on this machine"):  # a check never makes one
        digest_key.digest(b"x", "label", root)
    first = digest_key.digest(b"x", "label", root, create=True)
    assert oct(key.stat().st_mode & 0o777) == "0o600" and oct(key.parent.stat().st_mode & 0o777) == "0o700"
    assert sorted(p.name for p in key.parent.iterdir()) == [key.name]  # no temporary file left
    assert digest_key.digest(b"x", "label", root, create=True) == first != digest_key.digest(b"x", "other label", root)
    key.chmod(0o640)
    with pytest.raises(PipelineError, match="only you can read and write"):
        digest_key.digest(b"x", "label", root)
    monkeypatch.setenv(envvars.DIGEST_KEY, str(tmp_path / "checkpoints" / "tiny" / "key"))
    with pytest.raises(PipelineError, match="lies under the checkpoints root"):
        digest_key.digest(b"x", "label", root, create=True)


# ---- item 10: the ranks' memory against the host's, the disk check against a real save ----------------

def test_a_cpu_run_needing_more_memory_than_the_host_has_is_refused_before_launch(world, monkeypatch, capsys):
    from pipeline.errors import PipelineError
    from pipeline.launch import launcher
    from pipeline.training import memory
    from test_e2e_hostile_inputs import _tiny_spec

    spec = _tiny_spec(world.root)
    need = memory.host_need(spec)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: need // 2)  # a host with half of it
    monkeypatch.setattr(launcher, "_run_teeing_stderr", lambda *a: pytest.fail("torchrun was started"))
    with pytest.raises(PipelineError, match=rf"2 rank\(s\) need about {need / 2**30:.1f} GiB on this host .* has "
                                            rf"{need / 2**31:.1f} GiB.*Fix: .*FORCE=1"):
        launcher.launch(spec)
    world.unchanged()  # refused before the run directory (or its lock) exists
    monkeypatch.setattr(launcher, "_run_teeing_stderr", lambda *a: (0, []))
    launcher.launch(spec, force=True)
    assert capsys.readouterr().err.count("launching anyway (FORCE=1)") == 1
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: need)
    assert memory.check_host(spec) is None  # what fits passes, without a word


def test_a_dry_run_says_its_launch_would_be_refused(world, monkeypatch, capsys):
    from pipeline import envvars
    from pipeline.__main__ import main
    from pipeline.training import memory

    monkeypatch.setenv(envvars.CHECKPOINTS, str(world.root))
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 1 << 30)
    assert main(["train", "--model", "tiny", "--path", "native", "--dry-run", "--nproc-per-node", "64"]) == 0
    err = capsys.readouterr().err
    assert "warning: a launch would be refused: 64 rank(s) need about" in err and "has 1.0 GiB" in err
    world.unchanged()


def test_the_disk_check_expects_what_a_save_really_writes(trained_root, tmp_path):
    """The estimate against the save the fixture's run recorded (DCP with the tied embedding's second
    name, and the HF save): within 2 % and never under; the old estimate was 133 MiB for tiny's 171."""
    from dataclasses import replace

    from pipeline.run import diskspace
    from pipeline.run.rundir import RunDir

    run = RunDir(runs_dir(trained_root, "tiny", "native"))
    saved = [json.loads(line) for line in run.saves.read_text().splitlines()][-1]
    real = saved["dcp_bytes"] + saved["hf_bytes"]
    estimate = diskspace.save_bytes(replace(run.spec(), run_dir=str(tmp_path / "new-run")))  # nothing recorded there
    assert real <= estimate <= real * 1.02, (estimate / 2**20, real / 2**20)
    assert diskspace.save_bytes(run.spec()) >= real  # a run that recorded a larger save expects that one


def test_a_launch_with_a_key_others_can_read_is_refused_before_torchrun(world, tmp_path, monkeypatch):
    from pipeline import envvars
    from pipeline.errors import PipelineError
    from pipeline.launch import launcher
    from test_e2e_hostile_inputs import _tiny_spec

    key = tmp_path / "shared-key"
    key.write_text("ab" * 32 + "\n")
    key.chmod(0o644)
    monkeypatch.setenv(envvars.DIGEST_KEY, str(key))
    monkeypatch.setattr(launcher, "_run_teeing_stderr", lambda *a: pytest.fail("torchrun was started"))
    with pytest.raises(PipelineError, match="only you can read and write"):
        launcher.launch(_tiny_spec(world.root))


def test_a_moved_root_exports_its_run_without_training_again(trained_root, tmp_path):
    moved = tmp_path / "moved" / "checkpoints"
    shutil.copytree(trained_root, moved, symlinks=True)
    away = trained_root.with_name("moved-away")
    trained_root.rename(away)  # the old place is gone, as after `mv`
    try:
        result = cli("export", "--model", "tiny", "--path", "native", root=moved, bounded=False)
        assert result.returncode == 0, result.stderr[-3000:]
        assert manifest.check(runs_dir(moved, "tiny", "native") / "export")["step"] == 2
    finally:
        away.rename(trained_root)
