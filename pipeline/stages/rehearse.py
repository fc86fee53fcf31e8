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

Step-1 agreement with the plain run. Both runs see the same global batch (checked tensor by tensor),
so their step-1 numbers differ only by the plan's arithmetic: bf16 compute (8 significant bits,
relative rounding 2^-8 ≈ 0.4 %) in a different order (TP partial sums, gathered sequence shards).
The plan itself is exact: run in float32 it reproduces the plain run (tiny-moe, native and hf:
loss 8.33933, grad norm 3.6136, both as the plain run's to the printed digits).
- LOSS_TOLERANCE 2e-2: the loss is the float32 mean of per-token cross-entropies over the batch's
  512 label tokens, from bf16 logits; independent roundings average out. Measured: the plain run in
  bf16 (no TP) moves the tiny models' loss (≈ 8.3) by 8e-5 to 1.6e-3, and the rehearsals stay within
  1.4e-3. 2e-2 is ≥ 10× that and below one bf16 step of the loss itself (2^-8 × 8.3 ≈ 0.03), the
  same bound verify puts on a bf16 run's logged loss. A plan error in the forward (a partial sum
  lost or doubled, attention across sequence shards) changes a layer's output by O(1), not by
  rounding; the hf path's logits read as the wrong vocab shard failed outright.
- GRAD_NORM_TOLERANCE, relative, per model kind: the step-1 gradient norm checks the backward (norm
  gradients summed over tp under SP, FSDP's fp32 reduce-scatter). Dense: 5 %. transformers' Qwen3
  in bf16 is itself 3.2 % off its float32 norm on tiny with no parallelism at all (plain 2-rank run:
  0.57488 vs 0.59403; native 0.7 %), the rehearsal's hf run is within 0.5 % of that bf16 plain run,
  and in float32 the same TP 2 + SP + SAC plan reproduces the plain norm to 3e-6 relative. MoE: bf16 router logits flip the
  top-k choice of near-tied tokens, and each flip moves whole expert gradients; the plain run in bf16
  (no TP) is 7.8 % (native) and 10.3 % (hf) off its float32 norm on tiny-moe, and the rehearsals
  are within 0.15 % of those bf16 plain runs, so 15 %.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text
from pipeline.models import registry
from pipeline.run import store
from pipeline.run.rundir import RunDir
from pipeline.run.spec import RunSpec
from pipeline.training import rehearsal
from pipeline.training.rehearsal import Check
from pipeline.training.resolve import RunRequest, resolve

LOSS_TOLERANCE = 2e-2  # |rehearsed − plain| step-1 loss (bf16 plan vs fp32 run); see the module docstring
GRAD_NORM_TOLERANCE = {"dense": 5e-2, "moe": 0.15}  # relative, step-1 gradient norm; see the module docstring
# The two-node runs are the plain CPU run's world (2 ranks, fp32) split over two launches: same numbers.
NODES_LOSS_TOLERANCE = 1e-5
EXPORT_DTYPE = "float32"  # a 2-step bf16 plan at trn2's lr moves weights below bf16's resolution
SCHEDULERS = ("slurm", "eks")
SUMMARY = "rehearse.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="tiny or tiny-moe (any downloaded model whose heads split over 2)")
    parser.add_argument("--paths", default=",".join(registry.names()), help="comma-separated training paths")
    parser.add_argument("--steps", type=int, default=rehearsal.STEPS)
    parser.add_argument("--nodes", type=int, default=2, help="two-node rehearsal of the launch files (0: skip)")
    parser.add_argument("--schedulers", default=",".join(SCHEDULERS), help="whose rendered node command to run")


class Summary:
    def __init__(self, model: str, out: Path):
        self.out = out
        self.data: dict = {"model": model, "paths": {}, "nodes": {}, "seconds": {}}
        self.checks: list[tuple[str, Check]] = []

    def check(self, where: str, check: Check) -> Check:
        self.checks.append((where, check))
        mark = "pass" if check.passed else "FAIL"
        print(f"  {where:<12} {check.name:<30} {mark}  {check.detail}", flush=True)
        return check

    def save(self) -> None:
        self.data["checks"] = [{"where": w, **asdict(c)} for w, c in self.checks]
        self.data["passed"] = bool(self.checks) and all(c.passed for _, c in self.checks)
        atomic_write_text(self.out / SUMMARY, json.dumps(self.data, indent=2, default=str) + "\n")


def run(args: argparse.Namespace) -> dict:
    from pipeline.stages import train

    paths = [registry.get(p).name for p in args.paths.split(",") if p]
    home = store.home(args.model)
    source = home.source_dir()
    if not home.data_file.exists():
        raise PipelineError(f"{home.data_file} does not exist.", f"run `make data MODEL={args.model}` first.")
    out = home.rehearse
    out.mkdir(parents=True, exist_ok=True)
    summary = Summary(args.model, out)
    started = time.perf_counter()

    print(f"rehearse {args.model}: plain CPU run (configs/{rehearsal.HOST_TARGET}.toml) …", flush=True)
    plain_spec = resolve(RunRequest(model=args.model, path="native", target=rehearsal.HOST_TARGET, steps=args.steps,
                                    run_dir=out / "plain"))
    plain = _timed(summary, "plain", lambda: train.launch(plain_spec, fresh=True))
    plain_run = RunDir(Path(plain.run_dir))
    plain_step1 = _step1(plain_run)
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
                _rehearse_nodes(args, scheduler, out, plain_step1, summary)
            except PipelineError as err:
                summary.check(f"nodes-{scheduler}", Check("ran", False, err.problem))
            summary.save()

    summary.data["seconds"]["total"] = round(time.perf_counter() - started, 1)
    summary.save()
    failed = [(w, c) for w, c in summary.checks if not c.passed]
    print(f"{'PASSED' if not failed else 'FAILED'}: {len(summary.checks) - len(failed)}/{len(summary.checks)} checks, "
          f"{summary.data['seconds']['total']} s → {out / SUMMARY}", flush=True)
    if failed:
        where, check = failed[0]
        raise PipelineError(f"rehearse failed ({len(failed)} of {len(summary.checks)} checks), first: {where} "
                            f"{check.name}: {check.detail}", f"see {out / SUMMARY}.")
    return summary.data


def _timed(summary: Summary, name: str, fn):
    started = time.perf_counter()
    try:
        return fn()
    finally:
        summary.data["seconds"][name] = round(time.perf_counter() - started, 1)


def _step1(run: RunDir) -> dict:
    record = next((r for r in run.metric_records() if r["step"] == 1), None)
    if record is None:
        raise PipelineError(f"{run.metrics} has no step 1.", f"read the rank logs in {run.logs}.")
    return {"loss": record["loss"], "grad_norm": record["grad_norm"]}


def _rehearse_path(args, path: str, source: Path, out: Path, plain_run: RunDir, plain_step1: dict,
                   summary: Summary) -> None:
    from pipeline.stages import export as export_stage
    from pipeline.stages import train
    from pipeline.stages import verify as verify_stage

    arch = plain_run.spec().arch
    planned = rehearsal.plan(path, arch, steps=args.steps)
    spec = resolve(RunRequest(model=args.model, path=path, target=rehearsal.HOST_TARGET, settings=planned.settings,
                              run_dir=out / path))
    spec.record_plan = True
    print(f"  differences from configs/{rehearsal.PLAN_TARGET}.toml [train]/[paths.{path}]:", flush=True)
    for d in planned.differences:
        print(f"    {d.key}: {d.planned!r} → {d.rehearsed!r} ({d.reason})", flush=True)
    _timed(summary, path, lambda: train.launch(spec, fresh=True))
    run = RunDir(Path(spec.run_dir))
    entry = summary.data["paths"][path] = {
        "run_dir": str(run.path), "settings": asdict(spec.settings),
        "differences": [asdict(d) for d in planned.differences], "overrides": spec.overrides, "nki": spec.nki,
    }
    records = run.plan_records()
    for check in rehearsal.check_plan(spec.settings, arch, registry.get(path).landmarks, records):
        summary.check(path, check)
    entry["ran"] = _what_ran(records)

    summary.check(path, _same_batch(plain_run, run, records))
    step1 = entry["step1"] = _step1(run)
    diff = abs(step1["loss"] - plain_step1["loss"])
    summary.check(path, Check("step-1 loss vs plain run", diff <= LOSS_TOLERANCE,
                              f"{step1['loss']:.6f} ({spec.settings.dtype}, TP {spec.settings.tensor_parallel}) vs "
                              f"plain {plain_step1['loss']:.6f} (float32): |diff| {diff:.2e} ≤ {LOSS_TOLERANCE:g}"))
    rel = abs(step1["grad_norm"] - plain_step1["grad_norm"]) / plain_step1["grad_norm"]
    kind = "moe" if arch.is_moe else "dense"
    summary.check(path, Check("step-1 grad norm vs plain run", rel <= GRAD_NORM_TOLERANCE[kind],
                              f"{step1['grad_norm']:.6f} vs plain {plain_step1['grad_norm']:.6f}: "
                              f"relative diff {rel:.2e} ≤ {GRAD_NORM_TOLERANCE[kind]:g} ({kind})"))
    last = max((r["step"] for r in run.metric_records()), default=0)
    summary.check(path, Check("steps", last == args.steps, f"logged steps 1..{last} of {args.steps}"))

    exported = _timed(summary, f"{path} export", lambda: export_stage.export(
        export_stage.ExportConfig(run=run, dtype=EXPORT_DTYPE, force=True)))
    result = _timed(summary, f"{path} verify", lambda: verify_stage.verify(exported, source, run, run.verify))
    failed = [c.name for c in result.checks if not c.passed]
    summary.check(path, Check("export + verify-checkpoint", result.passed,
                              f"{len(result.checks) - len(failed)}/{len(result.checks)} verify checks pass"
                              + (f"; failed: {failed}" if failed else "") + f" ({run.verify})"))
    entry["verify"] = {"passed": result.passed, "step1_loss": result.step1_loss, "file": str(run.verify)}


def _what_ran(records: list[dict]) -> dict:
    """Rank 0's view, for the summary: mesh, collectives per mesh dimension, the model's module
    classes (which implementation each path trains: transformers', torchtitan's, NKI overrides)."""
    r = records[0]
    return {"mesh": {k: v["size"] for k, v in r["mesh"]["dims"].items()}, "collectives": r["step"]["collectives"],
            "module_classes": sorted(set(r["layout"]["modules"].values())),
            "hooked_modules": sorted(r["step"]["modules"])}


def _same_batch(plain: RunDir, rehearsed: RunDir, records: list[dict]) -> Check:
    """Each data-parallel rank of the rehearsal read the plain run's batch of the same rank."""
    import torch
    from safetensors.torch import load_file

    plain_files = sorted(plain.first_batch.glob("rank*.safetensors"))
    mismatched = []
    for record in records:
        dp = record["mesh"]["dims"]["dp_shard"]["coordinate"]
        ours = load_file(str(rehearsed.first_batch / f"rank{record['mesh']['rank']}.safetensors"))
        theirs = load_file(str(plain.first_batch / f"rank{dp}.safetensors"))
        if set(ours) != set(theirs) or not all(torch.equal(ours[k], theirs[k]) for k in ours):
            mismatched.append(record["mesh"]["rank"])
    return Check("same batch as plain run", not mismatched and len(plain_files) == len({
        r["mesh"]["dims"]["dp_shard"]["coordinate"] for r in records}),
        f"{len(records)} ranks' step-1 batches equal the plain run's batch of their data-parallel rank "
        f"({len(plain_files)} plain ranks)" + (f"; differ on ranks {mismatched}" if mismatched else ""))


# ---- two nodes from the rendered launch files --------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _render(args, scheduler: str, out: Path) -> tuple[Path, dict]:
    from pipeline.stages import launch

    run_dir = out / "run"
    launch_args = argparse.Namespace(
        scheduler=scheduler, nodes=args.nodes, model=args.model, path="native", steps=args.steps, seq_len=None,
        nproc_per_node=1, target=rehearsal.HOST_TARGET, image=None, runtime="venv", venv=str(Path(sys.executable).parent.parent),
        cluster_checkpoints=str(store.checkpoints_root().resolve()), compile_cache=None, namespace="default",
        pvc="fsx-claim", output=out / "files", run_dir=str(run_dir),
        local_image_ok=True)  # the rehearsal runs the pods' command here, no image is pulled
    written = launch.run(launch_args)
    return run_dir, written


def node_commands(scheduler: str, written: dict, nodes: int, port: int) -> tuple[list[tuple[str, dict]], Path]:
    """Each node's command exactly as the rendered file gives it, with the environment its node would
    have (the scheduler's node index, the rendezvous endpoint on 127.0.0.1), and the run.json it reads."""
    import yaml

    from pipeline.stages import launch

    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RDZV_ID": f"rehearse-{port}"}
    if scheduler == "slurm":
        script = written["train.sbatch"].read_text()
        start = script.index("<<'NODE'\n") + len("<<'NODE'\n")
        command = script[start:script.index("\nNODE\n", start)]
        exports = dict(line.removeprefix("export ").split("=", 1) for line in script.splitlines()
                       if line.startswith("export ") and "=" in line and "$" not in line)
        env = {**base, **{k: shlex.split(v)[0] for k, v in exports.items()}}
        return [(command, {**env, "SLURM_NODEID": str(i), "NODE_RANK": str(i)}) for i in range(nodes)], written["run.json"]
    docs = {d["kind"]: d for d in yaml.safe_load_all(written["job.yaml"].read_text())}
    (container,) = docs["Job"]["spec"]["template"]["spec"]["containers"]
    run_json = written["job.yaml"].with_name("run.json")  # what the ConfigMap mounts at RUN_JSON_IN_POD
    run_json.write_text(docs["ConfigMap"]["data"]["run.json"])
    # The pod's image paths → this machine's: the image's venv python and the ConfigMap's mount.
    command = (container["command"][-1].replace(launch.IMAGE_PYTHON, sys.executable)
               .replace(launch.RUN_JSON_IN_POD, str(run_json)))
    env = {**base, **{e["name"]: e["value"] for e in container["env"] if "value" in e},
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # the pod-0 DNS name and port → this machine
    return [(command, {**env, "JOB_COMPLETION_INDEX": str(i), "NODE_RANK": str(i)}) for i in range(nodes)], run_json


def _rehearse_nodes(args, scheduler: str, out: Path, plain_step1: dict, summary: Summary) -> None:
    import shutil

    where = f"nodes-{scheduler}"
    node_out = out / where
    if node_out.exists():
        shutil.rmtree(node_out)
    run_dir, written = _render(args, scheduler, node_out)
    port = _free_port()
    commands, run_json = node_commands(scheduler, written, args.nodes, port)
    started = time.perf_counter()
    procs = []
    for i, (command, env) in enumerate(commands):
        log = open(node_out / f"node-{i}.out", "w")
        procs.append((subprocess.Popen(["bash", "-c", command], env=env, cwd=store.REPO, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=1800))
        finally:
            log.close()
    summary.data["seconds"][where] = round(time.perf_counter() - started, 1)
    run = RunDir(run_dir)
    entry = summary.data["nodes"][scheduler] = {"files": {k: str(v) for k, v in written.items()},
                                                "commands": [c for c, _ in commands], "exit_codes": codes,
                                                "run_dir": str(run_dir)}
    summary.check(where, Check("nodes exit 0", codes == [0] * args.nodes,
                               f"exit codes {codes}; output in {node_out}/node-*.out"))
    if codes != [0] * args.nodes:
        return
    spec = RunSpec.load(run_json)
    logs = sorted(p.name for p in run.logs.iterdir() if p.is_dir())
    ranks = sorted(p.name for p in run.first_batch.glob("rank*.safetensors"))
    ok = (spec.settings.nnodes == args.nodes and logs == [f"node-{i}" for i in range(args.nodes)]
          and len(ranks) == args.nodes * spec.settings.nproc_per_node)
    summary.check(where, Check("one world over the nodes", ok,
                               f"nnodes {spec.settings.nnodes} × {spec.settings.nproc_per_node} rank; torchrun logs "
                               f"{logs}; step-1 batches of {ranks}"))
    last = max((r["step"] for r in run.metric_records()), default=0)
    step1 = entry["step1"] = _step1(run)
    diff = abs(step1["loss"] - plain_step1["loss"])
    summary.check(where, Check("steps and step-1 loss", last == args.steps and diff <= NODES_LOSS_TOLERANCE,
                               f"steps 1..{last}; step-1 loss {step1['loss']:.6f} vs plain {plain_step1['loss']:.6f} "
                               f"(same 2-rank float32 world): |diff| {diff:.2e} ≤ {NODES_LOSS_TOLERANCE:g}"))
