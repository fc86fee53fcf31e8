"""Stage `eval`: a run's export through lm-evaluation-harness (its own venv, `make setup-lm-eval`), on the tasks
made of the run's held-out split or the harness's own; results in the run's eval.json and the export's card
(pipeline.outputs.harness)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.models import registry
from pipeline.outputs import harness
from pipeline.run import store
from pipeline.run.rundir import RunLock

# `make setup-lm-eval`'s venv in the repository (the Makefile's LM_EVAL_VENV)
DEFAULT_HARNESS = Path(__file__).resolve().parents[2] / ".venv-lm-eval" / "bin" / "lm-eval"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--path", required=True, choices=registry.names(), help="training path of the run")
    parser.add_argument("--name", help="the run's name (RUN_NAME; default: the path's name)")
    parser.add_argument("--tasks", default=",".join(harness.LOCAL_TASKS),
                        help="comma-separated lm-eval tasks: the local ones (default) and/or the harness's own")
    parser.add_argument("--limit", type=int, help="at most this many documents per task")
    parser.add_argument("--harness", type=Path, default=DEFAULT_HARNESS, help="the lm-eval executable")


def run(args: argparse.Namespace) -> dict:
    tasks = [t.strip() for t in args.tasks.split(",")]
    if not all(tasks):
        raise PipelineError(f"EVAL_TASKS={args.tasks!r} names an empty task.", "give comma-separated task names.")
    if args.limit is not None and args.limit <= 0:
        raise PipelineError(f"--limit {args.limit} evaluates nothing.", "give a positive number, or leave it out.")
    run_dir = store.home(args.model).run(args.name or args.path)
    run_dir.spec()  # no run there: say so before a lock file is made
    if not run_dir.export.is_dir():
        raise PipelineError(f"{run_dir.export} does not exist: nothing to evaluate.",
                            f"run `make export MODEL={args.model} TRAIN_PATH={args.path}` first.")
    with RunLock(run_dir, activity="evaluating"):  # no export replaces what is read meanwhile
        return harness.evaluate(run_dir, tasks, args.harness, args.limit)
