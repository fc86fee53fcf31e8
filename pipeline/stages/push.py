"""Stage `push`: push the built image to a registry and record its digest for launch
(pipeline.host.push)."""

from __future__ import annotations

import argparse

from pipeline.host.image import client
from pipeline.host.push import check_registry, push
from pipeline.launch import pushed
from pipeline.launch.image import default_tag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--registry", required=True, help="<registry host>/<repository>, e.g. "
                        "<account>.dkr.ecr.<region>.amazonaws.com/qwen3 or 127.0.0.1:5000/qwen3")
    parser.add_argument("--image", help="the local image to push (default: this lock's qwen3-pipeline:lock-<hash>)")


def run(args: argparse.Namespace) -> str:
    registry = check_registry(args.registry)
    local = args.image or default_tag()
    reference = push(client(), local, registry)
    path = pushed.record(local, reference, f"{registry}:{local.rsplit(':', 1)[-1]}")
    print(f"pushed {reference}\nrecorded in {path}: make launch-slurm / launch-eks use it for {local}")
    return reference
