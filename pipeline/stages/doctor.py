"""Stage `doctor`: what this host (or the pipeline image) has vs what the pipeline needs, one row per
check (the checks: pipeline.host.doctor)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

from pipeline import envvars
from pipeline.errors import PipelineError
from pipeline.host.doctor import Check, checks, default_lock, inside_image_rows, table
from pipeline.run import store, targets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="cpu, cuda or trn2 (detected when unset)")
    parser.add_argument("--lock", type=Path, help="lock to compare against (default: requirements.lock on trn2, "
                                                    "requirements-dev.lock elsewhere)")
    parser.add_argument("--all-packages", action="store_true", help="list every pin, not only the ones that differ")
    parser.add_argument("--venv", type=Path, default=store.REPO / ".venv",
                        help="the environment the stages run in (default: the project's .venv)")
    parser.add_argument("--in-container", action="store_true", default=_on(os.environ.get("IN_CONTAINER")),
                        help="the stages run in the pipeline image (IN_CONTAINER=1): check the image, not this venv")
    parser.add_argument("--image", default=os.environ.get(envvars.IMAGE), help="--in-container: the image")
    parser.add_argument("--inside-image", action="store_true", help=argparse.SUPPRESS)  # the image's own half


def _on(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def run(args: argparse.Namespace) -> list[Check]:
    target = targets.resolve(args.target).name
    if getattr(args, "inside_image", False):
        rows = inside_image_rows(target)
        print(json.dumps([asdict(r) for r in rows]))
        return rows
    in_container = getattr(args, "in_container", False)  # callers that build args by hand may omit these
    rows = checks(target, args.lock or default_lock(target), packages="all" if args.all_packages else "problems",
                  venv=getattr(args, "venv", store.REPO / ".venv"), in_container=in_container,
                  image=getattr(args, "image", None))
    print(f"target: {target}; stages run {'in the image' if in_container else 'in this environment'}")
    print(table(rows))
    failed = [r.name for r in rows if r.status == "FAIL"]
    if failed:
        raise PipelineError(f"{len(failed)} check(s) failed for target {target}: {', '.join(failed[:5])}.",
                            "fix the FAIL rows above (see `make doctor`).")
    return rows
