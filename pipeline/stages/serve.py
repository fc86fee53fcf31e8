"""Stage `serve`: vLLM's OpenAI-compatible server on a run's export, in the foreground (pipeline.outputs.serve)."""

from __future__ import annotations

import argparse

from pipeline import flags
from pipeline.models import registry
from pipeline.outputs import serve
from pipeline.run.ref import RunRef


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, RunRef, choices={"path": registry.names()})
    flags.add_flags(parser, serve.ServeRequest)


def run(args: argparse.Namespace) -> None:
    ref = RunRef(**flags.values(RunRef, args))
    serve.serve(ref.run_dir(), serve.ServeRequest(**flags.values(serve.ServeRequest, args)))
