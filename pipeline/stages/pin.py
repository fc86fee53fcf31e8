"""Stage `pin`: resolve, once, the torchtitan-neuron commit, the Hub revisions and the base image digest
the trn2 run needs, and write each where it belongs (pipeline.host.pins); prints what to commit."""

from __future__ import annotations

import argparse
import os

from pipeline.host import pins
from pipeline.run import store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-image", default=os.environ.get("BASE_IMAGE") or None,
                        help="the base to pin instead of configs/base-image.toml's reference (default: BASE_IMAGE)")


def run(args: argparse.Namespace) -> list[pins.Pin]:
    resolved = pins.resolve(base_image=args.base_image)
    if not resolved:
        print("everything is pinned: requirements.lock, configs/models.toml and configs/base-image.toml name a "
              "commit or digest each; nothing was looked up.")
        return resolved
    print("pinned now (this run uses them; commit them so no later run looks them up):")
    for pin in resolved:
        print(f"  {pin.what:<52} {pin.value}  → {pin.file.relative_to(store.REPO)}")
    files = " ".join(sorted({str(p.file.relative_to(store.REPO)) for p in resolved}))
    print(f"commit exactly these files as this run left them: git diff -- {files}")
    return resolved
