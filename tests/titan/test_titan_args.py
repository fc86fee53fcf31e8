"""TITAN_ARGS: torchtitan's own flags over the Trainer.Config the pipeline builds, parsed by
torchtitan's parser, checked in the launcher (one line naming a bad flag, nothing launched) and
applied in the ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipeline.errors import PipelineError
from pipeline.titan.args import apply_titan_args
from helpers import REPO, cli
from tiny_checkpoint import ok, one_error_line

# Full tier: each test here runs the CLI in a fresh interpreter (seconds apiece).
pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The config tiny's native run would build (a dry-run spec: no download needed)."""
    from pipeline.training import entry
    from pipeline.training.resolve import RunRequest, resolve

    root = tmp_path_factory.mktemp("empty-root")
    spec = resolve(RunRequest(model="tiny", path="native", target="cpu", dry_run=True, checkpoints_root=root))
    return entry.build_config(spec)


def test_flags_change_only_what_they_name(built):
    changed = apply_titan_args(built, ["--training.steps", "1", "--lr-scheduler.warmup-steps", "0"])
    assert (built.training.steps, changed.training.steps) == (10, 1)
    assert changed.lr_scheduler.warmup_steps == 0
    assert changed.training.seq_len == built.training.seq_len and changed.run_dir == built.run_dir
    assert changed.override.imports == built.override.imports
    assert apply_titan_args(built, []) is built


@pytest.mark.parametrize("args, named, hint", [
    (["--training.stepz", "1"], "--training.stepz", "--training.steps"),
    # The form the example uses does not exist in torchtitan 0.3.0: lr lives in param groups.
    (["--optimizer.lr", "3e-4"], "--optimizer.lr", "--optimizer.param-groups.0.optimizer-kwargs.lr"),
    (["--training.steps", "1", "--nonsense"], "--nonsense", None),
])
def test_unknown_flag_is_named(built, args, named, hint):
    with pytest.raises(PipelineError) as err:
        apply_titan_args(built, args)
    problem = err.value.problem
    assert f"torchtitan has no flag {named}" in problem and "\n" not in str(err.value)
    assert (f"did you mean {hint}?" in problem) if hint else "did you mean" not in problem


def test_bad_value_is_named(built):
    with pytest.raises(PipelineError) as err:
        apply_titan_args(built, ["--training.steps", "many"])
    assert "--training.steps" in err.value.problem and "many" in err.value.problem
    assert "\n" not in str(err.value) and "│" not in str(err.value)


def test_launcher_imports_torchtitan_only_for_titan_args(tmp_path):
    code = ("import sys; from pipeline.training.resolve import RunRequest, resolve; from pathlib import Path; "
            "resolve(RunRequest(model='tiny', path='native', target='cpu', dry_run=True, "
            "checkpoints_root=Path(sys.argv[1]), titan_args=tuple(sys.argv[2:]))); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'torchtitan'}))")
    plain = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True)
    assert plain.returncode == 0 and plain.stdout.strip() == "[]", plain.stderr[-2000:]
    with_args = subprocess.run([sys.executable, "-c", code, str(tmp_path), "--training.steps", "1"], cwd=REPO,
                               capture_output=True, text=True)
    assert with_args.returncode == 0 and "torchtitan" in with_args.stdout, with_args.stderr[-2000:]


def test_help_lists_the_flags(tmp_path):
    result = cli("train", "--model", "tiny", "--path", "native", "--dry-run", "--titan-args=--help",
                          root=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--training.steps" in result.stdout and "--lr-scheduler.warmup-steps" in result.stdout


def test_bad_flag_refuses_before_launch(tiny_root):
    result = cli("train", "--model", "tiny", "--path", "native", "--fresh",
                          "--titan-args=--training.steps 1 --training.stepz 2", root=tiny_root)
    line = one_error_line(result)
    assert "torchtitan has no flag --training.stepz (did you mean --training.steps?)" in line
    assert "launching" not in result.stdout
    assert not (tiny_root / "tiny" / "runs" / "native" / "run.json").exists()


def test_training_steps_flag_changes_what_runs(tiny_root):
    """STEPS=3 asks for three steps; TITAN_ARGS='--training.steps 1' over it really runs one, and the
    settings the checks read say so (folded before the checks: pipeline.training.titan_flags)."""
    ok(cli("train", "--model", "tiny", "--path", "native", "--steps", "3", "--nproc-per-node", "1",
                    "--fresh", "--titan-args=--training.steps 1", root=tiny_root))
    run_dir = tiny_root / "tiny" / "runs" / "native"
    spec = json.loads((run_dir / "run.json").read_text())
    assert spec["titan_args"] == ["--training.steps", "1"] and spec["settings"]["steps"] == 1
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == ["step-1"]  # the last step's save
