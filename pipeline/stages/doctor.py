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
    parser.add_argument("--titan", action="store_true",
                        help="only the installed torchtitan: every name, field and signature the pipeline uses, and "
                             "whether it has it (exits non-zero naming what is missing; runs inside the image)")
    parser.add_argument("--inside-image", action="store_true", help=argparse.SUPPRESS)  # the image's own half


def _on(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def run(args: argparse.Namespace) -> list[Check]:
    target = targets.resolve(args.target).name
    if getattr(args, "titan", False):
        return titan(target)
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
        raise PipelineError(f"{len(failed)} check(s) failed for target {target}: {', '.join(failed)}.",
                            "fix the FAIL rows above (see `make doctor`).")
    return rows


def titan(target: str) -> list[Check]:
    """doctor --titan: the installed torchtitan against every torchtitan name the pipeline uses on `target`
    (pipeline.titan.internals), in one table; what is missing is named in the one-line error."""
    from pipeline.titan import api, internals

    try:
        variant = api.variant()
    except ModuleNotFoundError as err:
        raise PipelineError("torchtitan is not installed in this environment.",
                            "run it where the stages run (the image, or the project venv).") from err
    rows = [Check(name, f"{kind}, on {on}: {why}", found,
                  "FAIL" if found.startswith("MISSING") else "ok" if found != "not used on this API" else "-")
            for name, kind, on, why, found in internals.table_rows(target, variant)]
    print(f"torchtitan {internals.torchtitan_version()}: {api.DESCRIPTION[variant]}; target {target}")
    print(table(rows))
    missing = [r.name for r in rows if r.status == "FAIL"]
    if missing:
        raise PipelineError(f"torchtitan {internals.torchtitan_version()} lacks {len(missing)} of the names this "
                            f"pipeline uses: {', '.join(missing)}.",
                            "port pipeline/titan/ to it (docs/torchtitan-apis.md says what each torchtitan API asks "
                            "for), or install the torchtitan the lock pins.")
    return rows
