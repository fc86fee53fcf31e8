"""Stage `paths`: the training paths the registry holds, one line, for Make and the trn2 workflow
(`for p in $(python -m pipeline paths)`), so no other file lists them."""

from __future__ import annotations

import argparse

from pipeline.models import registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--describe", action="store_true", help="one line per path: its name and what it trains")


def run(args: argparse.Namespace) -> tuple[str, ...]:
    names = registry.names()
    if args.describe:
        for name in names:
            print(f"{name}: {registry.get(name).summary}")
    else:
        print(" ".join(names))
    return names
