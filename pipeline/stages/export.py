"""Stage `export`: a run's last complete checkpoint as a Hugging Face checkpoint, <run dir>/export/
(the checks and links: pipeline.outputs.export)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline import flags
from pipeline.dtypes import NAMES as DTYPES
from pipeline.models import registry
from pipeline.outputs.export import ExportConfig, export, export_adapter
from pipeline.run.ref import RunRef
from pipeline.run.rundir import RunLock


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, RunRef, choices={"path": registry.names()})
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                        help="export dtype: the run's export_dtype (linked) or narrower (cast)")
    parser.add_argument("--step", type=int, help="checkpoint step to export (default: the last)")
    parser.add_argument("--force", action="store_true", help="replace an existing export (atomically)")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run's adapters alone, in PEFT's layout, to <run dir>/export-adapter")


def run(args: argparse.Namespace) -> Path:
    config = ExportConfig(run=RunRef(**flags.values(RunRef, args)).run_dir(), dtype=args.dtype,
                          step=args.step, force=args.force)
    config.run.spec()  # no run there: say so before a lock file is made
    with RunLock(config.run, activity="exporting"):  # no training or second export writes there meanwhile
        return export_adapter(config) if args.adapter else export(config)
