"""Stage `summary`: the table `make pipeline` ends with, one row per model × path run
(pipeline.outputs.pipeline_summary)."""

from __future__ import annotations

import argparse

from pipeline.models import registry
from pipeline.outputs import pipeline_summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", required=True, help="MODEL values (as given to download)")
    parser.add_argument("--paths", nargs="+", choices=registry.names(), default=list(registry.names()),
                        help="training paths (default: every path)")


def run(args: argparse.Namespace) -> list[pipeline_summary.Row]:
    found = pipeline_summary.rows(args.models, args.paths)
    print(pipeline_summary.table(found))
    return found
