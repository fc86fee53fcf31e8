"""Stage `launch`: render multi-node launch files (Slurm sbatch, EKS manifests); torchrun does the
launching, never this code (the renderers: pipeline.training.cluster)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline import flags
from pipeline.models import registry
from pipeline.run.settings import TrainSettings
from pipeline.training.cluster import LaunchRequest, plan, render, write


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, LaunchRequest, choices={"path": registry.names()})
    flags.add_flags(parser, TrainSettings, unset_default=True)  # as train's: over the config files when given


def request(args: argparse.Namespace) -> LaunchRequest:
    return LaunchRequest(**flags.values(LaunchRequest, args), flags=flags.values(TrainSettings, args, given_only=True))


def run(args: argparse.Namespace) -> dict[str, Path]:
    plan_ = plan(request(args))
    rendered = render(plan_)
    if args.dry_run:
        for name, text in rendered.items():
            print(f"==> {plan_.output / name} (not written: dry run)\n{text}")
        return {}
    return write(plan_, rendered)
