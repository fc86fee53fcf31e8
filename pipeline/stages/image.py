"""Stage `image`: build the container image through the Docker SDK, or run a stage inside it
(pipeline.host.image)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from pipeline import envvars
from pipeline.host.image import BuildSpec, build, container_run, run_in_image
from pipeline.run import store
from pipeline.launch.image import DEFAULT_BASE_IMAGE, build_key, default_tag


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-image", default=os.environ.get("BASE_IMAGE") or DEFAULT_BASE_IMAGE)
    parser.add_argument("--lock", type=Path, default=store.REPO / "requirements.lock")
    parser.add_argument("--tag", help="image tag (default: qwen3-pipeline:lock-<lock sha256[:12]>)")
    parser.add_argument("--python", default="python3", help="the base image's Python")
    parser.add_argument("--wheelhouse", type=Path, help="an existing wheelhouse with requirements.hashed.txt "
                        "(default: build/wheelhouse/<lock hash>, made inside the base image when missing)")
    parser.add_argument("--pip-mount", action="append", default=[],
                        help="host directory mounted at the same path while the wheelhouse is made (local indexes)")
    parser.add_argument("--image", default=os.environ.get(envvars.IMAGE), help="--run: the image (default: --tag)")
    parser.add_argument("--run", nargs=argparse.REMAINDER, metavar="STAGE ARGS",
                        help="run `python -m pipeline STAGE ARGS` in the image instead of building")


def build_spec(args: argparse.Namespace) -> BuildSpec:
    key = build_key(args.lock, args.base_image)
    return BuildSpec(base_image=args.base_image, lock=Path(args.lock),
                     tag=args.tag or default_tag(args.lock, args.base_image),
                     wheelhouse=Path(args.wheelhouse or store.REPO / "build" / "wheelhouse" / key),
                     python=args.python, pip_mounts=tuple(args.pip_mount))


def run(args: argparse.Namespace):
    if args.run is not None:
        image = args.image or args.tag or default_tag(args.lock, args.base_image)
        code = run_in_image(container_run(image, args.run))
        if code != 0:
            # The stage inside already printed its own error; keep its exact status.
            raise SystemExit(code)
        return code
    if shutil.which("git") is None:
        print("note: git not found; the image's revision label will read 'unknown'", file=sys.stderr)
    return build(build_spec(args))
