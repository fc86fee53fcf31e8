"""Stage `report`: loss curves and a summary table of a model's runs (pipeline.outputs.report)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline import console, flags
from pipeline.outputs.report import collect, write_report
from pipeline.run import store
from pipeline.run.ref import RunRef


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, RunRef, only=("model",))


def run(args: argparse.Namespace) -> Path:
    home = store.home(args.model)
    collection = collect(home)
    report = write_report(collection, home.report)
    if console.brief():  # make pipeline's end table has the numbers
        for warning in collection.warnings:
            print(f"warning: {warning}")
    else:
        print((report / "summary.md").read_text(), end="")  # its notes name each warning (once)
    print(f"report: {report}")
    return report
