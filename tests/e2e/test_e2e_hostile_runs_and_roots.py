"""Hostile and careless inputs on the newer surfaces (issue 28: runs, roots, run records), with the
harness of test_e2e_hostile_inputs: each is refused in one `error: … Fix: …` line, exit status 2,
and nothing outside the run changes."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from helpers import REPO, copy_model
from test_e2e_hostile_inputs import MARKER, World, cli, make, one_error_line, snapshot


@pytest.fixture
def world(tmp_path) -> World:
    return World(tmp_path)


def one_make_error_line(result: subprocess.CompletedProcess, *expected: str) -> str:
    """A refusal by make itself (before any recipe): exit 2 and one line, `Makefile:N: *** error: … Fix: ….  Stop.`"""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    match = re.fullmatch(r"Makefile:\d+: \*\*\* (error: .+ Fix: .+)\.  Stop\.", lines[0])
    assert match, lines[0]
    for fragment in expected:
        assert fragment in match.group(1), (fragment, match.group(1))
    return match.group(1)


def make_dry(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`make -n …`: what the recipes would run, nothing run."""
    clean = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "IN_CONTAINER")}
    return subprocess.run(["make", "-n", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**clean, **(env or {})})


# ---- item 1: an empty value never changes which run a command touches ----------------------------------

def _after_a_pipeline_run(world: World, checkpoints: Path) -> Path:
    """The world's root holding tiny (linked) and a finished native run: its record, export and verify."""
    copy_model(checkpoints, world.root, "tiny", link=True)
    native = world.root / "tiny" / "runs" / "native"
    (native / "export").mkdir(parents=True)
    (native / "run.json").write_text(json.dumps({"path": "native", "steps": 2}))
    (native / "export" / "model.safetensors").write_bytes(b"the pipeline's export")
    (native / "verify.json").write_text(json.dumps({"passed": True}))
    world.before = world.state()
    return native


def test_sft_with_an_empty_run_name_leaves_the_native_run_alone(world, checkpoints):
    """`make sft RUN_NAME= FRESH=1` trained with no name (runs/native) and replaced its export and verify."""
    native = _after_a_pipeline_run(world, checkpoints)
    result = make("sft", "RUN_NAME=", "FRESH=1", "STEPS=1", root=world.root)
    one_make_error_line(result, "RUN_NAME is set empty")
    assert "launching" not in result.stdout
    assert (native / "export" / "model.safetensors").read_bytes() == b"the pipeline's export"
    world.unchanged()


@pytest.mark.parametrize("goal, variable", [("sft", "RUN_NAME"), ("lora", "RUN_NAME"), ("sft", "CONFIG"),
                                            ("lora", "CONFIG"), ("export", "RUN_NAME"), ("export", "MODEL"),
                                            ("export", "TRAIN_PATH"), ("export", "DTYPE"), ("train-native", "MODEL"),
                                            ("data", "VENV"), ("setup", "PYTHON"), ("data", "IN_CONTAINER")])
def test_an_empty_value_of_a_defaulted_variable_is_refused(goal, variable):
    one_make_error_line(make_dry(goal, f"{variable}=", "FRESH=1"), f"{variable} is set empty")
    # from the environment too (`RUN_NAME=$UNSET make sft`): make's ?= takes it as set
    one_make_error_line(make_dry(goal, "FRESH=1", env={variable: ""}), f"{variable} is set empty")


def test_an_empty_value_whose_default_is_empty_is_that_default():
    """CONFIG's default is empty outside sft/lora: CONFIG= is the same command as no CONFIG."""
    given, unset = make_dry("train-native", "CONFIG=", "DRY_RUN=1"), make_dry("train-native", "DRY_RUN=1")
    assert given.returncode == 0 and given.stdout == unset.stdout, given.stderr


@pytest.mark.parametrize("stage", ["export", "verify", "publish"])
def test_an_empty_run_name_is_not_the_paths_run(world, stage):
    """`--name ''` read as no name meant the training path's run (native)."""
    extra = ["--repo", "me/model", "--dry-run"] if stage == "publish" else []
    result = cli(stage, "--model", "tiny", "--path", "native", "--name", "", *extra, root=world.root)
    one_error_line(result, "RUN_NAME=''")
    world.unchanged()


# ---- item 12: a newline in a value is refused, never split into recipe lines -----------------------------

@pytest.mark.parametrize("variable", ["MODEL", "DATASET", "TITAN_ARGS", "RUN_NAME", "HUB_REPO", "HF_HOME"])
def test_a_newline_in_a_value_runs_no_second_command(world, variable):
    """`make -i` (ignore errors) ran the line after the newline as a command of its own."""
    value = f"tiny\ntouch {world.canary}"
    goal = "publish" if variable == "HUB_REPO" else "data"
    result = make("-i", goal, f"{variable}={value}", root=world.root)
    one_make_error_line(result, f"{variable} holds a newline")
    world.unchanged()


def test_a_newline_from_the_environment_is_refused_too(world):
    result = make("-i", "data", root=world.root, env_extra={"DATASET": f"local\ntouch {world.canary}"})
    one_make_error_line(result, "DATASET holds a newline")
    world.unchanged()


# ---- item 2: a stage marks only a root it made; clean deletes only what the pipeline wrote ---------------

def _other_projects(root: Path) -> None:
    for part in ("project/data", "project/runs", "thesis/report"):
        (root / part).mkdir(parents=True)
        (root / part / "work.txt").write_text("theirs")
    (root / "notes.txt").write_text("mine")


def _theirs(root: Path) -> dict:
    return {k: v for k, v in snapshot(root).items() if k.split(os.sep)[0] in ("project", "thesis", "notes.txt")}


def test_a_stage_in_a_folder_of_other_projects_arms_no_clean(tmp_path):
    root = tmp_path / "shared"
    _other_projects(root)
    before = _theirs(root)
    assert cli("data", "--model", "tiny", root=root).returncode == 0
    assert not (root / MARKER).exists()
    for target in ("clean", "distclean"):
        one_error_line(make(target, "VENV=" + str(tmp_path / "no-venv"), root=root), f"{root} carries no {MARKER}")
    assert _theirs(root) == before and (root / "tiny" / "data").is_dir()


def test_a_stage_marks_an_empty_root_with_the_keys_it_made(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    assert cli("data", "--model", "tiny", root=root).returncode == 0
    marker = root / MARKER
    assert marker.is_file() and not marker.is_symlink()
    assert "tiny" in marker.read_text().splitlines()


def test_a_marker_that_is_a_link_is_no_marker(tmp_path):
    root, elsewhere = tmp_path / "linked", tmp_path / "a-real-marker"
    _other_projects(root)
    elsewhere.write_text("")
    (root / MARKER).symlink_to(elsewhere)
    before = _theirs(root)
    assert cli("data", "--model", "tiny", root=root).returncode == 0
    assert elsewhere.read_text() == ""  # nothing recorded through the link
    one_error_line(make("clean", root=root), f"{root} carries no {MARKER}")
    assert _theirs(root) == before


def test_clean_and_distclean_delete_only_what_the_pipeline_wrote(tmp_path):
    """Other projects put into a root the pipeline made stay, through clean and distclean."""
    root = tmp_path / "ours"
    assert cli("data", "--model", "tiny", root=root).returncode == 0
    (root / "tiny" / "runs" / "native").mkdir(parents=True)
    (root / "data" / "sets" / "c4").mkdir(parents=True)  # the sets the stages share (staged shards, splits)
    _other_projects(root)
    before = _theirs(root)
    result = make("clean", root=root)
    assert result.returncode == 0, result.stderr
    assert not (root / "tiny" / "data").exists() and not (root / "tiny" / "runs").exists()
    assert not (root / "data").exists() and "data" not in result.stdout.split("left what", 1)[-1]
    assert "project, thesis" in result.stdout and _theirs(root) == before
    result = make("distclean", "VENV=" + str(tmp_path / "no-venv"), root=root)
    assert result.returncode == 0, result.stderr
    assert not (root / "tiny").exists() and _theirs(root) == before and (root / MARKER).is_file()


# ---- items 9 and 11: a run's records are read only when they are regular files holding what the pipeline wrote ----

def _a_run(root: Path, run_json: str | None) -> Path:
    """runs/native of tiny with logged progress and `run_json` as its record (None: a FIFO in its place)."""
    run = root / "tiny" / "runs" / "native"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    if run_json is None:
        os.mkfifo(run / "run.json")
    else:
        (run / "run.json").write_text(run_json)
    return run


STAGES = {"export": ("export", "--model", "tiny", "--path", "native"),
          "verify": ("verify", "--model", "tiny", "--path", "native"),
          "train": ("train", "--model", "tiny", "--path", "native", "--steps", "1", "--dry-run")}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_a_fifo_in_place_of_run_json_is_refused_unread(world, stage):
    """Opening a FIFO blocks until a writer comes: export hung there holding the run's lock."""
    run = _a_run(world.root, None)
    world.before = world.state()
    one_error_line(cli(*STAGES[stage], root=world.root), f"{run / 'run.json'} is not a regular file")
    world.unchanged()


TORN = ('{"model": "tiny", "path": "nat', "is not valid JSON")
NOT_AN_OBJECT = ('["a", "list"]', "holds a JSON list")
NOT_A_RECORD = ('{"model": "tiny"}', "is not a run's record")  # train compares it instead (other settings)


@pytest.mark.parametrize("stage, content, said", [(stage, *case) for stage in sorted(STAGES) for case in
                                                  (TORN, NOT_AN_OBJECT, *([NOT_A_RECORD] if stage != "train" else []))])
def test_a_torn_or_foreign_run_json_is_one_line(world, stage, content, said):
    run = _a_run(world.root, content)
    world.before = world.state()
    one_error_line(cli(*STAGES[stage], root=world.root), f"{run / 'run.json'} {said}", "FRESH=1")
    world.unchanged()


def _run_under(root: Path, export_runs: Path, checkpoints: Path) -> Path:
    """A copy of a trained tiny run (its step-0 HF save) as tiny's run `run` of `root`."""
    from helpers import fake_run

    copy_model(checkpoints, root, "tiny", link=True)
    (root / "tiny" / "runs").mkdir(parents=True, exist_ok=True)
    return fake_run(export_runs, root / "tiny" / "runs")


def test_a_fifo_in_place_of_the_recorded_hashes_is_refused_unread(world, export_runs, checkpoints):
    run = _run_under(world.root, export_runs, checkpoints)
    hashes = run / "checkpoint" / "step-0" / "hf" / ".sha256.json"
    hashes.unlink(missing_ok=True)
    os.mkfifo(hashes)
    result = cli("export", "--model", "tiny", "--path", "native", "--name", "run", "--dtype", "float32", root=world.root)
    one_error_line(result, f"{hashes} is not a regular file")
    assert not (run / "export").exists()


def test_corrupt_lora_adapters_are_one_line(world, export_runs, checkpoints):
    run = _run_under(world.root, export_runs, checkpoints)
    spec = json.loads((run / "run.json").read_text())
    spec["settings"]["lora_rank"] = 8
    (run / "run.json").write_text(json.dumps(spec))
    adapters = run / "checkpoint" / "step-0" / "lora_adapters.safetensors"
    adapters.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"torn\": ")
    result = cli("export", "--model", "tiny", "--path", "native", "--name", "run", "--adapter", "--dtype", "float32",
                 root=world.root)
    one_error_line(result, f"{adapters} is not a readable safetensors file", "FRESH=1")
    assert not (run / "export-adapter").exists()


def _verified_export(root: Path) -> Path:
    """A run whose export verify passed, as publish checks it (manifest.json's hashes and verdict)."""
    from pipeline.checkpoint import manifest

    export = root / "tiny" / "runs" / "native" / "export"
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"weights")
    manifest.write(export, {"step": 2, "dtype": "float32", "verify": {"passed": True}})
    return export


PUBLISH = ("publish", "--model", "tiny", "--path", "native")


@pytest.mark.parametrize("repo", ["me/bad name", "me/x..y", "-me/model", "me/model.git", "me/" + "a" * 97])
def test_publish_refuses_an_invalid_hub_repo_in_a_dry_run_too(world, repo):
    _verified_export(world.root)
    world.before = world.state()
    one_error_line(cli(*PUBLISH, f"--repo={repo}", "--dry-run", root=world.root), f"HUB_REPO={repo!r} is not a Hub repository id")
    world.unchanged()


@pytest.mark.parametrize("repo", ["me/bad name", "-me/model"])
def test_make_publish_refuses_an_invalid_hub_repo(world, repo):
    _verified_export(world.root)
    world.before = world.state()
    one_error_line(make("publish", f"HUB_REPO={repo}", "DRY_RUN=1", root=world.root), f"HUB_REPO={repo!r} is not a Hub")
    world.unchanged()


@pytest.mark.parametrize("env, said", [({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
                                       ({"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}, "could not be reached")])
def test_publish_without_the_hub_is_one_line(world, env, said):
    """Offline, or no network (a closed port stands in): one line, no published.json."""
    _verified_export(world.root)
    world.before = world.state()
    result = cli(*PUBLISH, "--repo", "me/model", root=world.root, env={"HF_TOKEN": "hf_not_a_real_token", **env})
    line = one_error_line(result, said)
    assert "hf_not_a_real_token" not in result.stdout + result.stderr and "hf_not" not in line
    world.unchanged()


def test_a_fifo_in_place_of_a_weights_file_is_refused_unread(world, tmp_path):
    from tiny_checkpoint import small_random_checkpoint

    model = small_random_checkpoint(tmp_path / "model")
    (shard,) = model.glob("*.safetensors")
    shard.unlink()
    os.mkfifo(shard)
    one_error_line(cli("download", "--model", str(model), root=world.root), f"{shard} is not a regular file")
    world.unchanged()
