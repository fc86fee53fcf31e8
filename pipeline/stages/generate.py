"""Stage `generate`: a quick look at a run's export: greedy completions of PROMPT by vLLM (pipeline.outputs.serve)."""

from __future__ import annotations

import argparse

from pipeline import flags
from pipeline.models import registry
from pipeline.outputs import serve
from pipeline.run.ref import RunRef

SERVING_FIELDS = ("max_model_len", "kv_cache_gib", "compile", "vllm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, RunRef, choices={"path": registry.names()})
    flags.add_flags(parser, serve.GenerateRequest)
    flags.add_flags(parser, serve.ServeRequest, only=SERVING_FIELDS)


def run(args: argparse.Namespace) -> list[dict]:
    ref = RunRef(**flags.values(RunRef, args))
    request = serve.GenerateRequest(**flags.values(serve.GenerateRequest, args))
    serving = serve.ServeRequest(**flags.values(serve.ServeRequest, args, only=SERVING_FIELDS))
    records = serve.generate(ref.run_dir(), [request.prompt], request.max_tokens, serving)
    for record in records:
        print(f"{record['prompt']}\n→ {record['text']}")
    return records
