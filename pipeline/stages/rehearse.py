"""Stage `rehearse`: configs/trn2.toml's parallel plan, executed for real on CPU gloo ranks.

For one model, into checkpoints/<key>/rehearse/:
  plain/         the plain CPU run (configs/cpu.toml as is, float32, native path): the baseline
  <path>/        for hf, native and nki: the trn2 plan (pipeline.training.rehearsal: TP with sequence
                 parallelism, FSDP over the remaining ranks, selective activation checkpointing, bf16
                 parameters with fp32 reduction) on TP × 2 ranks; every rank records what it ran
                 (plan/rank<N>.json), then export and verify-checkpoint of the run
  nodes-slurm/, nodes-eks/   the per-node command `make launch-slurm` / `launch-eks` render, run as
                 two "nodes" on this machine (c10d rendezvous on 127.0.0.1, one CPU rank each)
  rehearse.json  every difference from trn2.toml with its reason, every check and measurement
A check that fails makes the stage fail (one line naming it) after everything ran.
(The checks and their tolerances: pipeline.launch.rehearsal_runs.)
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from pipeline import flags
from pipeline.errors import Check, PipelineError
from pipeline.launch import launcher, rehearsal_runs
from pipeline.models import registry
from pipeline.outputs import export, verify
from pipeline.run import store
from pipeline.run.ref import RunRef
from pipeline.run.rundir import RunDir
from pipeline.training import rehearsal
from pipeline.training.resolve import RunRequest, resolve

SCHEDULERS = ("slurm", "eks")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, RunRef, only=("model",),
                    overrides={"model": {"help": "tiny or tiny-moe (any downloaded model whose heads split over 2)"}})
    parser.add_argument("--paths", default=",".join(registry.names()), help="comma-separated training paths")
    parser.add_argument("--steps", type=int, default=rehearsal.STEPS)
    parser.add_argument("--nodes", type=int, default=2, help="two-node rehearsal of the launch files (0: skip)")
    parser.add_argument("--schedulers", default=",".join(SCHEDULERS), help="whose rendered node command to run")


def run(args: argparse.Namespace) -> dict:
    paths = [registry.get(p).name for p in args.paths.split(",") if p]
    home = store.home(args.model)
    source = home.source_dir()
    if not home.data_file.exists():
        raise PipelineError(f"{home.data_file} does not exist.", f"run `make data MODEL={args.model}` first.")
    out = home.rehearse
    out.mkdir(parents=True, exist_ok=True)
    summary = rehearsal_runs.Summary(args.model, out)
    started = time.perf_counter()

    print(f"rehearse {args.model}: plain CPU run (configs/{rehearsal.HOST_TARGET}.toml) …", flush=True)
    plain_spec = resolve(RunRequest(model=args.model, path="native", target=rehearsal.HOST_TARGET, directory=out / "plain",
                                    flags={"steps": args.steps}))
    plain = _timed(summary, "plain", lambda: launcher.launch(plain_spec, fresh=True))
    plain_run = RunDir(Path(plain.run_dir))
    plain_step1 = rehearsal_runs.step1(plain_run)
    summary.data["plain"] = {"run_dir": str(plain_run.path), "settings": asdict(plain.settings), **plain_step1}

    for path in paths:
        print(f"rehearse {args.model}: {path} path, trn2 plan …", flush=True)
        try:
            _rehearse_path(args, path, source, out, plain_run, plain_step1, summary)
        except PipelineError as err:
            summary.check(path, Check("ran", False, err.problem))
        summary.save()

    if args.nodes:
        for scheduler in [s for s in args.schedulers.split(",") if s]:
            print(f"rehearse {args.model}: {args.nodes} nodes from the rendered {scheduler} files …", flush=True)
            try:
                rehearsal_runs.rehearse_nodes(args.model, args.steps, args.nodes, scheduler, out, plain_step1,
                                              summary)
            except PipelineError as err:
                summary.check(f"nodes-{scheduler}", Check("ran", False, err.problem))
            summary.save()

    summary.data["seconds"]["total"] = round(time.perf_counter() - started, 1)
    summary.save()
    failed = [(w, c) for w, c in summary.checks if not c.passed]
    print(f"{'PASSED' if not failed else 'FAILED'}: {len(summary.checks) - len(failed)}/{len(summary.checks)} checks, "
          f"{summary.data['seconds']['total']} s → {out / rehearsal_runs.SUMMARY}", flush=True)
    if failed:
        where, check = failed[0]
        raise PipelineError(f"rehearse failed ({len(failed)} of {len(summary.checks)} checks), first: {where} "
                            f"{check.name}: {check.detail}", f"see {out / rehearsal_runs.SUMMARY}.")
    return summary.data


def _timed(summary: rehearsal_runs.Summary, name: str, fn):
    started = time.perf_counter()
    try:
        return fn()
    finally:
        summary.data["seconds"][name] = round(time.perf_counter() - started, 1)


def _rehearse_path(args, path: str, source: Path, out: Path, plain_run: RunDir, plain_step1: dict,
                   summary: rehearsal_runs.Summary) -> None:
    arch = plain_run.spec().arch
    planned = rehearsal.plan(path, arch, steps=args.steps)
    spec = resolve(RunRequest(model=args.model, path=path, target=rehearsal.HOST_TARGET, settings=planned.settings,
                              directory=out / path))
    spec.record_plan = True
    print(f"  differences from configs/{rehearsal.PLAN_TARGET}.toml [train]/[paths.{path}]:", flush=True)
    for d in planned.differences:
        print(f"    {d.key}: {d.planned!r} → {d.rehearsed!r} ({d.reason})", flush=True)
    _timed(summary, path, lambda: launcher.launch(spec, fresh=True))
    run = RunDir(Path(spec.run_dir))
    entry = summary.data["paths"][path] = {
        "run_dir": str(run.path), "settings": asdict(spec.settings),
        "differences": [asdict(d) for d in planned.differences], "overrides": spec.overrides, "nki": spec.nki,
    }
    records = run.plan_records()
    for check in rehearsal.check_plan(spec.settings, arch, registry.get(path).landmarks, records):
        summary.check(path, check)
    entry["ran"] = rehearsal_runs.what_ran(records)

    summary.check(path, rehearsal_runs.same_batch(plain_run, run, records))
    step1 = entry["step1"] = rehearsal_runs.step1(run)
    diff = abs(step1["loss"] - plain_step1["loss"])
    summary.check(path, Check("step-1 loss vs plain run", diff <= rehearsal_runs.LOSS_TOLERANCE,
                              f"{step1['loss']:.6f} ({spec.settings.dtype}, TP {spec.settings.tensor_parallel}) vs "
                              f"plain {plain_step1['loss']:.6f} (float32): |diff| {diff:.2e} ≤ {rehearsal_runs.LOSS_TOLERANCE:g}"))
    rel = abs(step1["grad_norm"] - plain_step1["grad_norm"]) / plain_step1["grad_norm"]
    kind = "moe" if arch.is_moe else "dense"
    summary.check(path, Check("step-1 grad norm vs plain run", rel <= rehearsal_runs.GRAD_NORM_TOLERANCE[kind],
                              f"{step1['grad_norm']:.6f} vs plain {plain_step1['grad_norm']:.6f}: "
                              f"relative diff {rel:.2e} ≤ {rehearsal_runs.GRAD_NORM_TOLERANCE[kind]:g} ({kind})"))
    last = max((r["step"] for r in run.metric_records()), default=0)
    summary.check(path, Check("steps", last == args.steps, f"logged steps 1..{last} of {args.steps}"))

    exported = _timed(summary, f"{path} export", lambda: export.export(
        export.ExportConfig(run=run, dtype=spec.settings.export_dtype, force=True)))
    result = _timed(summary, f"{path} verify", lambda: verify.verify(exported, source, run, run.verify))
    failed = [c.name for c in result.checks if not c.passed]
    summary.check(path, Check("export + verify-checkpoint", result.passed,
                              f"{len(result.checks) - len(failed)}/{len(result.checks)} verify checks pass"
                              + (f"; failed: {failed}" if failed else "") + f" ({run.verify})"))
    entry["verify"] = {"passed": result.passed, "step1_loss": result.step1_loss, "file": str(run.verify)}
