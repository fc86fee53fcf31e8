"""Stage `report`: loss curves and a summary table of a model's runs (pipeline.outputs.report)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.outputs.report import collect, write_report
from pipeline.run import store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="MODEL as given to download")


def run(args: argparse.Namespace) -> Path:
    home = store.home(args.model)
    collection = collect(home)
    for warning in collection.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    report = write_report(collection, home.report)
    print((report / "summary.md").read_text(), end="")
    print(f"report: {report}")
    return report
