"""Stage `launch`: render multi-node launch files (Slurm sbatch, EKS manifests); torchrun does the
launching, never this code (the renderers: pipeline.launch.cluster)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline import flags
from pipeline.models import registry
from pipeline.run.settings import TrainSettings
from pipeline.launch.cluster import RUN_FLAGS, LaunchRequest, plan, render, write
from pipeline.training.resolve import RunRequest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, RunRequest, choices={"path": registry.names()}, overrides=RUN_FLAGS)  # as train's
    flags.add_flags(parser, LaunchRequest)
    flags.add_flags(parser, TrainSettings, unset_default=True)  # as train's: over the config files when given


def request(args: argparse.Namespace) -> LaunchRequest:
    return LaunchRequest(run=RunRequest.from_args(args), **flags.values(LaunchRequest, args))


def run(args: argparse.Namespace) -> dict[str, Path]:
    plan_ = plan(request(args))
    rendered = render(plan_)
    if args.dry_run:
        for name, text in rendered.items():
            print(f"==> {plan_.output / name} (not written: dry run)\n{text}")
        return {}
    return write(plan_, rendered)
