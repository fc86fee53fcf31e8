"""`python -m pipeline <stage> …`: every stage, each with --help. The Makefile only calls this."""

from __future__ import annotations

import argparse
import errno
import importlib
import sys

from pipeline.errors import PipelineError

# stage name → (module with add_arguments(parser) and run(args), one-line help)
STAGES = {
    "download": ("pipeline.stages.download", "fetch or make the HF checkpoint (Hub, local dir, or embedded tiny/tiny-moe)"),
    "data": ("pipeline.stages.data", "write the training text torchtitan's loader reads"),
    "train": ("pipeline.stages.train", "launch a training path (hf, native, nki) with torchrun"),
    "export": ("pipeline.stages.export", "write a run's last checkpoint as HF safetensors"),
    "verify": ("pipeline.stages.verify", "prove an export reloads: keys, tensors, step-1 loss"),
    "verify-kernels": ("pipeline.stages.verify_kernels", "check every NKI override against its reference"),
    "smoke": ("pipeline.stages.smoke", "touch the devices first: device count, one op, a 2-rank all-reduce, the RoPE kernel"),
    "eval": ("pipeline.stages.eval", "a run's export through lm-evaluation-harness: held-out log-likelihood, multiple choice"),
    "serve": ("pipeline.stages.serve", "vLLM's OpenAI-compatible server on a run's export"),
    "generate": ("pipeline.stages.generate", "greedy completions of a prompt by vLLM on a run's export"),
    "publish": ("pipeline.stages.publish", "upload a run's verified export to a Hugging Face Hub model repository"),
    "report": ("pipeline.stages.report", "loss curves and a summary of a model's runs"),
    "summary": ("pipeline.stages.summary", "the table make pipeline ends with: each run's losses, export and verify"),
    "image": ("pipeline.stages.image", "build the container image through the Docker SDK"),
    "push": ("pipeline.stages.push", "push the built image to a registry and record its digest for launch"),
    "pin": ("pipeline.stages.pin", "resolve once the torchtitan-neuron commit, Hub revisions and base image digest, and record them"),
    "doctor": ("pipeline.stages.doctor", "what this host has vs what the pipeline needs"),
    "launch": ("pipeline.stages.launch", "render multi-node launch files (Slurm sbatch, EKS manifests)"),
    "paths": ("pipeline.stages.paths", "the training paths the registry holds (Make and the trn2 workflow read them here)"),
    "clean": ("pipeline.stages.clean", "delete what the pipeline wrote in its checkpoints root (--all: downloads too), nothing else"),
    "rehearse": ("pipeline.stages.rehearse", "run configs/trn2.toml's parallel plan on CPU ranks, and the launch files on two nodes"),
    "makevars": ("pipeline.stages.makevars", "write make/variables.mk, the Make variables and flags the dataclasses' fields give"),
}


class StageParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line naming the fix, like every other bad input, and a flag is
    never an abbreviation of another (`--name` is not `--namespace`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message}. Fix: see `{self.prog} --help`.\n")


# Writing where the user pointed us but cannot write is a user error in any stage.
UNWRITABLE = {errno.EACCES: "is not writable", errno.EROFS: "is on a read-only file system",
              errno.ENOTDIR: "has a file where a directory is needed", errno.ENOSPC: "is on a full disk",
              errno.EDQUOT: "is over its disk quota"}


def stage_parser(stage: str):
    """The stage's module (only the chosen stage is imported) and its command line."""
    module = importlib.import_module(STAGES[stage][0])
    parser = StageParser(prog=f"python -m pipeline {stage}", description=STAGES[stage][1])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    module.add_arguments(parser)
    return module, parser


THEN = "--then"  # `python -m pipeline export … --then verify …`: stages in order, in one process


def segments(argv: list[str]) -> list[list[str]]:
    """argv split at each `--then <stage>`: one Python start-up and one import of torch and transformers for stages
    run back to back (`make export-verify`, the fine-tuning targets)."""
    out = [[]]
    for i, word in enumerate(argv):
        if word != THEN:
            out[-1].append(word)
        elif i + 1 < len(argv) and argv[i + 1] in STAGES:
            out.append([])
        else:
            given = repr(argv[i + 1]) if i + 1 < len(argv) else "nothing"
            raise ValueError(f"{THEN} is followed by {given}, not a stage; the stages: {', '.join(STAGES)}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__, allow_abbrev=False,
                                     epilog="stages: " + "; ".join(f"{k}: {v[1]}" for k, v in STAGES.items())
                                     + f". `{THEN} <stage> …` runs another stage after it, in the same process.")
    parser.add_argument("stage", choices=STAGES)
    if not argv or argv[0] not in STAGES:
        parser.parse_args(argv[:1] or ["--help"])
    try:
        chain = segments(argv)
    except ValueError as err:
        parser.error(str(err))
    planned = []
    for segment in chain:  # every command line is parsed before the first stage runs
        module, stage_args = stage_parser(segment[0])
        planned.append((module, stage_args.parse_args(segment[1:])))
    for module, args in planned:
        code = _run(module, args, debug)
        if code:
            return code
    return 0


def _run(module, args: argparse.Namespace, debug: bool) -> int:
    try:
        module.run(args)
    except PipelineError as err:
        if debug:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if debug or err.errno not in UNWRITABLE or not err.filename:
            raise
        print(f"error: {err.filename} {UNWRITABLE[err.errno]} ({err.strerror}). Fix: free space or choose a writable "
              "location (PIPELINE_CHECKPOINTS sets the checkpoints root).", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
