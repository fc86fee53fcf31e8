"""Stage `export`: a run's last complete checkpoint as a Hugging Face checkpoint, <run dir>/export/
(the checks and links: pipeline.outputs.export)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline import flags
from pipeline.models import registry
from pipeline.outputs.export import ExportRequest, export, export_adapter
from pipeline.run.ref import RunRef
from pipeline.run.rundir import RunLock


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, RunRef, choices={"path": registry.names()})
    flags.add_flags(parser, ExportRequest)


def run(args: argparse.Namespace) -> Path:
    request = ExportRequest(**flags.values(ExportRequest, args))
    config = request.config(RunRef(**flags.values(RunRef, args)).run_dir())
    config.run.spec()  # no run there: say so before a lock file is made
    with RunLock(config.run, activity="exporting"):  # no training or second export writes there meanwhile
        return export_adapter(config) if request.adapter else export(config)
