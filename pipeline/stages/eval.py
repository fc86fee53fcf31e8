"""Stage `eval`: a run's export through lm-evaluation-harness (its own venv, `make setup-lm-eval`), on the tasks
made of the run's held-out split or the harness's own; results in the run's eval.json and the export's card
(pipeline.outputs.harness)."""

from __future__ import annotations

import argparse

from pipeline import flags
from pipeline.errors import PipelineError
from pipeline.models import registry
from pipeline.outputs import harness
from pipeline.run import store
from pipeline.run.ref import RunRef
from pipeline.run.rundir import RunLock


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, RunRef, choices={"path": registry.names()})
    flags.add_flags(parser, harness.EvalRequest)


def run(args: argparse.Namespace) -> dict:
    request = harness.EvalRequest(**flags.values(harness.EvalRequest, args))
    tasks = [t.strip() for t in request.tasks.split(",")]
    if not all(tasks):
        raise PipelineError(f"EVAL_TASKS={request.tasks!r} names an empty task.", "give comma-separated task names.")
    if request.limit is not None and request.limit <= 0:
        raise PipelineError(f"--limit {request.limit} evaluates nothing.", "give a positive number, or leave it out.")
    run_dir = store.home(args.model).run(args.name or args.path)
    run_dir.spec()  # no run there: say so before a lock file is made
    if not run_dir.export.is_dir():
        raise PipelineError(f"{run_dir.export} does not exist: nothing to evaluate.",
                            f"run `make export MODEL={args.model} TRAIN_PATH={args.path}` first.")
    with RunLock(run_dir, activity="evaluating"):  # no export replaces what is read meanwhile
        return harness.evaluate(run_dir, tasks, request.harness, request.limit)
