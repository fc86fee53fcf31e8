"""Stage `verify`: prove an export reloads (keys, tensors, step-1 loss) and record the verdict
(the checks: pipeline.outputs.verify)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeline import flags
from pipeline.checkpoint import manifest
from pipeline.errors import PipelineError
from pipeline.models import registry
from pipeline.outputs.verify import Verification, VerifyRequest, verify
from pipeline.outputs import model_card
from pipeline.run import rundir
from pipeline.run.ref import RunRef
from pipeline.run.rundir import RunDir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # MODEL with TRAIN_PATH (or RUN_NAME): that run's export; or CHECKPOINT with REFERENCE.
    flags.add_flags(parser, RunRef, choices={"path": registry.names()},
                    overrides={"model": {"required": False}, "path": {"required": False}})
    flags.add_flags(parser, VerifyRequest)


def run(args: argparse.Namespace) -> Verification:
    request = VerifyRequest(**flags.values(VerifyRequest, args))
    if args.model and (args.path or args.name is not None):
        run_dir = RunRef(**flags.values(RunRef, args)).run_dir()
        reference = Path(run_dir.spec().source_dir)
        checkpoint = run_dir.export
        if not checkpoint.is_dir():
            raise PipelineError(f"{checkpoint} does not exist.",
                                f"run `make export MODEL={args.model} "
                                f"{f'RUN_NAME={args.name}' if args.name else f'TRAIN_PATH={args.path}'}` first.")
    elif request.checkpoint and request.reference:
        checkpoint, reference = request.checkpoint, request.reference
        if not Path(checkpoint).is_dir():  # nothing to verify: no verify.json is written beside it
            raise PipelineError(f"CHECKPOINT {checkpoint} is not a directory.",
                                "give the HF checkpoint directory to verify (an export, e.g. <run dir>/export).")
        parent = RunDir(Path(checkpoint).parent)
        run_dir = parent if parent.exists() else None
    else:
        raise PipelineError("verify needs --model and --path, or --checkpoint and --reference.",
                            "e.g. `make verify-checkpoint MODEL=tiny TRAIN_PATH=native`.")
    if not Path(reference).is_dir():
        raise PipelineError(f"reference {reference} is not a directory.", "give the downloaded source checkpoint.")
    output = request.output or (run_dir.verify if run_dir else Path(checkpoint).parent / rundir.VERIFY)
    result = verify(Path(checkpoint), Path(reference), run_dir, output)
    if run_dir is not None and Path(checkpoint).resolve() == run_dir.export.resolve() \
            and (run_dir.export / manifest.MANIFEST).exists():
        model_card.record_verdict(run_dir.export, run_dir, result)  # the shared directory says how it fared
    failed = [c for c in result.checks if not c.passed]
    if failed:
        raise PipelineError(f"verify failed ({len(failed)} of {len(result.checks)} checks), first: {failed[0].name}: "
                            f"{failed[0].detail}", f"see {output}.")
    return result
