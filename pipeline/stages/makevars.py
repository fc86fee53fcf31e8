"""`python -m pipeline makevars`: write make/variables.mk, the Make interface the dataclasses' fields give
(pipeline.host.makevars); --check only says whether the committed file is current."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.host import makevars


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, default=makevars.OUTPUT, help="the file to write")
    parser.add_argument("--check", action="store_true", help="write nothing; fail when the file is not current")


def run(args: argparse.Namespace) -> Path:
    if args.output.is_dir():
        raise PipelineError(f"--output {args.output} is a directory.", "give the file to write, e.g. make/variables.mk.")
    if args.check:
        if not args.output.is_file() or args.output.read_text() != makevars.render():
            raise PipelineError(f"{args.output} is not what the dataclasses' fields give.",
                                f"run `{makevars.COMMAND}` and commit it.")
        print(f"{args.output} is current.")
        return args.output
    print(f"wrote {makevars.write(args.output)}")
    return args.output
