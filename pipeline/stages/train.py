"""Stage `train`: resolve one training run and launch it with torchrun.

`--path` chooses the training path (pipeline.models.registry); everything else — launcher,
data, metrics, checkpoints — is shared. A dry run resolves and validates everything, prints the
resolved run and the exact command, and launches nothing. The launch itself (the run's lock,
torchrun's output, the one-line diagnosis of a failure) is pipeline.launch.launcher.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from pipeline import flags
from pipeline.errors import PipelineError
from pipeline.launch import torchrun
from pipeline.launch.launcher import launch, memory_line
from pipeline.models import registry
from pipeline.run import continuation, targets
from pipeline.run.rundir import RunDir
from pipeline.run.settings import TrainSettings
from pipeline.titan import internals
from pipeline.training import memory
from pipeline.training.resolve import RunRequest, resolve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, RunRequest, choices={"path": registry.names()})
    flags.add_flags(parser, TrainSettings, unset_default=True)  # over the config files when given


def run(args: argparse.Namespace):
    target = targets.resolve(args.target)
    if not args.dry_run:
        targets.check_launchable(target)
    # The ranks build torchtitan's internals: a torchtitan without them is refused here, in one line.
    internals.check_torchtitan(target.name)
    spec = resolve(RunRequest.from_args(args))
    target = targets.TARGETS[spec.target]
    command = torchrun.command(spec)
    env_prefix = " ".join(f"{k}={v}" for k, v in target.launch_vars(dict(os.environ), memory.host_need(spec)).items())
    if not args.fresh:  # the launch checks again under the run's lock
        continuation.check_continues(RunDir(Path(spec.run_dir)), spec)
    if args.dry_run:
        try:
            refused = memory.check_host(spec, args.force)
        except PipelineError as err:  # the dry run shows the run and says what its launch would do
            refused = f"warning: a launch would be refused: {err}"
        if refused:
            print(refused, file=sys.stderr, flush=True)
        print(memory_line(spec))
        print(spec.to_json(), end="")
        print("launch command:")
        print(" ".join(part for part in (env_prefix, shlex.join(command)) if part))
        return spec
    return launch(spec, fresh=args.fresh, force=args.force)
