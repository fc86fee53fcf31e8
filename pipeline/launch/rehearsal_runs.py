"""What a rehearsal compares (stage `rehearse`): its runs against the plain CPU run, and the rendered
launch files run as two "nodes" on this machine; every check is recorded in rehearse.json.

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

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from pipeline.errors import Check, PipelineError
from pipeline.fsutil import atomic_write_text
from pipeline.run import rundir, store
from pipeline.launch.image import IMAGE
from pipeline.run.rundir import RunDir
from pipeline.run.spec import RunSpec
from pipeline.launch import cluster
from pipeline.training.rehearsal import HOST_TARGET
from pipeline.training.resolve import RunRequest


LOSS_TOLERANCE = 2e-2  # |rehearsed − plain| step-1 loss (bf16 plan vs fp32 run); see the module docstring


GRAD_NORM_TOLERANCE = {"dense": 5e-2, "moe": 0.15}  # relative, step-1 gradient norm; see the module docstring


# The two-node runs are the plain CPU run's world (2 ranks, fp32) split over two launches: same numbers.
NODES_LOSS_TOLERANCE = 1e-5


SUMMARY = "rehearse.json"


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


def step1(run: RunDir) -> dict:
    record = next((r for r in run.metric_records() if r["step"] == 1), None)
    if record is None:
        raise PipelineError(f"{run.metrics} has no step 1.", f"read the rank logs in {run.logs}.")
    return {"loss": record["loss"], "grad_norm": record["grad_norm"]}


def what_ran(records: list[dict]) -> dict:
    """Rank 0's view, for the summary: mesh, collectives per mesh dimension, the model's module
    classes (which implementation each path trains: transformers', torchtitan's, NKI overrides)."""
    r = records[0]
    return {"mesh": {k: v["size"] for k, v in r["mesh"]["dims"].items()}, "collectives": r["step"]["collectives"],
            "module_classes": sorted(set(r["layout"]["modules"].values())),
            "hooked_modules": sorted(r["step"]["modules"])}


def same_batch(plain: RunDir, rehearsed: RunDir, records: list[dict]) -> Check:
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_commands(scheduler: str, written: dict, nodes: int, port: int) -> tuple[list[tuple[str, dict]], Path]:
    """Each node's command exactly as the rendered file gives it, with the environment its node would
    have (the scheduler's node index, the rendezvous endpoint on 127.0.0.1), and the run.json it reads."""
    import yaml

    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RDZV_ID": f"rehearse-{port}"}
    if scheduler == "slurm":
        script = written["train.sbatch"].read_text()
        start = script.index("<<'NODE'\n") + len("<<'NODE'\n")
        command = script[start:script.index("\nNODE\n", start)]
        exports = dict(line.removeprefix("export ").split("=", 1) for line in script.splitlines()
                       if line.startswith("export ") and "=" in line and "$" not in line)
        env = {**base, **{k: shlex.split(v)[0] for k, v in exports.items()}}
        return [(command, {**env, "SLURM_NODEID": str(i), "NODE_RANK": str(i)}) for i in range(nodes)], written[rundir.RUN_JSON]
    docs = {d["kind"]: d for d in yaml.safe_load_all(written["job.yaml"].read_text())}
    (container,) = docs["Job"]["spec"]["template"]["spec"]["containers"]
    run_json = written["job.yaml"].with_name(rundir.RUN_JSON)  # what the ConfigMap mounts at RUN_JSON_IN_POD
    run_json.write_text(docs["ConfigMap"]["data"][rundir.RUN_JSON])
    # The pod's image paths → this machine's: the image's venv python and the ConfigMap's mount.
    command = (container["command"][-1].replace(IMAGE.python, sys.executable)
               .replace(cluster.RUN_JSON_IN_POD, str(run_json)))
    env = {**base, **{e["name"]: e["value"] for e in container["env"] if "value" in e},
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # the pod-0 DNS name and port → this machine
    return [(command, {**env, "JOB_COMPLETION_INDEX": str(i), "NODE_RANK": str(i)}) for i in range(nodes)], run_json


def run_nodes(commands: list[tuple[str, dict]], out: Path, timeout: float = 1800) -> list[int]:
    """Start every node's command at once (each in its own session, output to out/node-<i>.out) and
    wait for all of them: their exit codes, in node order."""
    procs = []
    for i, (command, env) in enumerate(commands):
        log = open(out / f"node-{i}.out", "w")
        procs.append((subprocess.Popen(["bash", "-c", command], env=env, cwd=store.REPO, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        finally:
            log.close()
    return codes


# ---- two nodes from the rendered launch files --------------------------------------------------


def _render(model: str, steps: int, nodes: int, scheduler: str, out: Path) -> tuple[Path, dict]:
    run_dir = out / "run"
    request = cluster.LaunchRequest(
        run=RunRequest(model=model, path="native", target=HOST_TARGET, flags={"steps": steps, "nproc_per_node": 1}),
        scheduler=scheduler, nodes=nodes, runtime="venv", venv=str(Path(sys.executable).parent.parent),
        cluster_checkpoints=str(store.checkpoints_root().resolve()), output=out / "files", run_dir=str(run_dir),
        local_image_ok=True)
    plan = cluster.plan(request)
    return run_dir, cluster.write(plan, cluster.render(plan))


def rehearse_nodes(model: str, steps: int, nodes: int, scheduler: str, out: Path, plain_step1: dict,
                   summary: Summary) -> None:
    """The rendered launch files' node command run as `nodes` nodes on this machine, checked as one world
    whose step 1 is the plain run's."""
    where = f"nodes-{scheduler}"
    node_out = out / where
    if node_out.exists():
        shutil.rmtree(node_out)
    run_dir, written = _render(model, steps, nodes, scheduler, node_out)
    port = free_port()
    commands, run_json = node_commands(scheduler, written, nodes, port)
    started = time.perf_counter()
    codes = run_nodes(commands, node_out)
    summary.data["seconds"][where] = round(time.perf_counter() - started, 1)
    run = RunDir(run_dir)
    entry = summary.data["nodes"][scheduler] = {"files": {k: str(v) for k, v in written.items()},
                                                "commands": [c for c, _ in commands], "exit_codes": codes,
                                                "run_dir": str(run_dir)}
    summary.check(where, Check("nodes exit 0", codes == [0] * nodes,
                               f"exit codes {codes}; output in {node_out}/node-*.out"))
    if codes != [0] * nodes:
        return
    spec = RunSpec.load(run_json)
    logs = sorted(p.name for p in run.logs.iterdir() if p.is_dir())
    ranks = sorted(p.name for p in run.first_batch.glob("rank*.safetensors"))
    ok = (spec.settings.nnodes == nodes and logs == [f"node-{i}" for i in range(nodes)]
          and len(ranks) == nodes * spec.settings.nproc_per_node)
    summary.check(where, Check("one world over the nodes", ok,
                               f"nnodes {spec.settings.nnodes} × {spec.settings.nproc_per_node} rank; torchrun logs "
                               f"{logs}; step-1 batches of {ranks}"))
    last = max((r["step"] for r in run.metric_records()), default=0)
    first = entry["step1"] = step1(run)
    diff = abs(first["loss"] - plain_step1["loss"])
    summary.check(where, Check("steps and step-1 loss", last == steps and diff <= NODES_LOSS_TOLERANCE,
                               f"steps 1..{last}; step-1 loss {first['loss']:.6f} vs plain {plain_step1['loss']:.6f} "
                               f"(same 2-rank float32 world): |diff| {diff:.2e} ≤ {NODES_LOSS_TOLERANCE:g}"))
