"""Stage `launch`: render multi-node launch files; torchrun does the launching, never this code.

`--scheduler slurm` writes an sbatch script, `--scheduler eks` Kubernetes manifests (a
ConfigMap with run.json, a headless Service for the rendezvous, an Indexed Job with one pod
per node). Both run the exact torchrun command `train` would, with c10d rendezvous on the
first node and the EFA environment. The model must already be downloaded (and the data
prepared) under the cluster's checkpoints directory, a filesystem every node shares.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.models import registry
from pipeline.run import store, targets
from pipeline.run.image import default_tag
from pipeline.run.spec import RunSpec
from pipeline.training import torchrun
from pipeline.training.memory import host_need
from pipeline.training.resolve import RunRequest, resolve

# Libfabric over EFA with GPU/Neuron-direct RDMA; fork-safe because torchrun forks ranks.
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
# Per target, what a node needs beyond the target's own launch environment. trn2 nodes talk over
# EFA; CPU nodes (the rehearsal of these files, `make rehearse`) over TCP with gloo.
LAUNCH_ENV = {"trn2": EFA_ENV, "cpu": {}}
RDZV_PORT = 29500
# trn2.48xlarge: 16 Trainium2 devices and 16 EFA interfaces per node.
NEURON_DEVICES_PER_NODE = 16
EFA_DEVICES_PER_NODE = 16
IMAGE_PYTHON = "/opt/pipeline-venv/bin/python"  # the venv the Dockerfile builds
IMAGE_WORKDIR = "/opt/pipeline"
RUN_JSON_IN_POD = "/etc/pipeline/run.json"


@dataclass(frozen=True)
class LaunchPlan:
    scheduler: str
    nodes: int
    image: str
    runtime: str  # slurm only: pyxis (the image through enroot) or venv
    venv: str
    cluster_checkpoints: str
    compile_cache: str
    output: Path
    namespace: str
    pvc: str
    spec: RunSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduler", required=True, choices=("slurm", "eks"))
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--path", default="native", choices=registry.names())
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--nproc-per-node", type=int, help="ranks per node (default: the target's config)")
    parser.add_argument("--target", default="trn2", choices=tuple(LAUNCH_ENV),
                        help="trn2 nodes; cpu renders the same files for CPU machines (the rehearsal runs them)")
    parser.add_argument("--image", help="image reference the cluster can pull (default: the lock-derived tag)")
    parser.add_argument("--runtime", default="pyxis", choices=("pyxis", "venv"),
                        help="slurm: run in the image via pyxis/enroot, or in a venv on the shared filesystem")
    parser.add_argument("--venv", default=None, help="slurm --runtime venv: the venv (default: this repo's .venv)")
    parser.add_argument("--cluster-checkpoints", default=None,
                        help="checkpoints directory as the nodes see it (default: /fsx/checkpoints for slurm, "
                             "/checkpoints for eks)")
    parser.add_argument("--compile-cache", default=None, help="persistent Neuron compile cache on shared storage")
    parser.add_argument("--namespace", default="default")
    parser.add_argument("--pvc", default="fsx-claim", help="eks: PersistentVolumeClaim holding the checkpoints")
    parser.add_argument("--output", type=Path, help="where to write (default: checkpoints/<key>/launch/<scheduler>-<N>)")
    parser.add_argument("--run-dir", help="the run's directory as the nodes see it "
                        "(default: <cluster checkpoints>/<key>/runs/<path>)")


def plan(args: argparse.Namespace) -> LaunchPlan:
    if args.nodes < 1:
        raise PipelineError(f"NODES={args.nodes} must be at least 1.", "give NODES ≥ 1.")
    default_ckpt = "/fsx/checkpoints" if args.scheduler == "slurm" else "/checkpoints"
    cluster_ckpt = args.cluster_checkpoints or default_ckpt
    if not cluster_ckpt.startswith("/"):
        raise PipelineError(f"--cluster-checkpoints {cluster_ckpt!r} is not absolute.", "give an absolute path.")
    for flag, value in (("--run-dir", args.run_dir), ("--output", args.output), ("--cluster-checkpoints", cluster_ckpt),
                        ("--compile-cache", args.compile_cache), ("--venv", args.venv), ("--image", args.image)):
        if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in str(value)):
            # A newline would end the script's line (or its heredoc) and start one of its own.
            raise PipelineError(f"{flag} {str(value)!r} holds a control character (a newline?).",
                                "give it without newlines or other control characters.")
    # The trn2 run with the paths the nodes see; TP/FSDP checked against the multi-node world.
    spec = resolve(RunRequest(model=args.model, path=args.path, target=args.target, steps=args.steps,
                              seq_len=args.seq_len, nproc_per_node=args.nproc_per_node, nnodes=args.nodes,
                              dry_run=True, checkpoints_root=Path(cluster_ckpt),
                              run_dir=Path(args.run_dir) if args.run_dir else None))
    output = args.output or store.home(args.model).launch / f"{args.scheduler}-{args.nodes}"
    return LaunchPlan(
        scheduler=args.scheduler, nodes=args.nodes, image=args.image or default_tag(), runtime=args.runtime,
        venv=args.venv or str(store.REPO / ".venv"), cluster_checkpoints=cluster_ckpt,
        compile_cache=args.compile_cache or f"{cluster_ckpt}/.neuron-compile-cache", output=Path(output),
        namespace=args.namespace, pvc=args.pvc, spec=spec)


def node_command(spec: RunSpec, python: str, run_json: str) -> str:
    """train's torchrun command for one node, as shell words: the ${VAR}s torchrun.NODE_EXPANSIONS
    names stay for the node's shell to expand, everything else (paths with `$(…)`, quotes, spaces)
    is single-quoted data."""
    command = torchrun.command(spec, python=python, run_json=run_json)
    return " ".join(shell_word(part) for part in command)


_EXPANSION = re.compile("(" + "|".join(re.escape(e) for e in torchrun.NODE_EXPANSIONS) + ")")


def shell_word(part: str) -> str:
    """One shell word: the launcher's own expansions double-quoted, every other piece shlex-quoted."""
    pieces = [p for p in _EXPANSION.split(part) if p]
    literals = [p for p in pieces if p not in torchrun.NODE_EXPANSIONS]
    if len(literals) == len(pieces):
        return shlex.quote(part)
    if all(shlex.quote(p) == p for p in literals):  # nothing in it the shell would read: one readable word
        return f'"{part}"'
    return "".join(f'"{p}"' if p in torchrun.NODE_EXPANSIONS else shlex.quote(p) for p in pieces)


def _env_lines(plan_: LaunchPlan) -> dict:
    target = plan_.spec.target
    cache = {targets.NEFF_CACHE_ENV: plan_.compile_cache} if target == "trn2" else {}
    # The target's run-size-dependent variables as `train` sets them (the nodes' memory assumed this host's).
    sized = targets.TARGETS[target].launch_vars({}, host_need(plan_.spec))
    return {**sized, **LAUNCH_ENV[target], **cache,
            "PIPELINE_CHECKPOINTS": plan_.cluster_checkpoints, "PYTHONUNBUFFERED": "1"}


def render_slurm(plan_: LaunchPlan) -> dict[str, str]:
    spec = plan_.spec
    run_json = str(plan_.output / "run.json")
    log_dir = plan_.output
    if plan_.runtime == "pyxis":
        mounts = ",".join(sorted({f"{plan_.cluster_checkpoints}:{plan_.cluster_checkpoints}",
                                  f"{plan_.compile_cache}:{plan_.compile_cache}", f"{plan_.output}:{plan_.output}"}))
        runtime = (f"--container-image={shlex.quote(plan_.image)} --container-mounts={shlex.quote(mounts)} "
                   f"--container-workdir={IMAGE_WORKDIR} --no-container-entrypoint ")
        python, workdir = IMAGE_PYTHON, IMAGE_WORKDIR
    else:
        runtime, python, workdir = "", f"{plan_.venv}/bin/python", str(store.REPO)
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in _env_lines(plan_).items())
    script = f"""#!/bin/bash
# Rendered by `python -m pipeline launch --scheduler slurm` for {spec.model_key} ({spec.path} path).
# One task per node; torchrun on each starts {spec.settings.nproc_per_node} ranks and meets the others through
# c10d rendezvous on the first node. Submit with: sbatch {plan_.output / "train.sbatch"}
#SBATCH --job-name=qwen3-{spec.model_key}-{spec.path}
#SBATCH --nodes={plan_.nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --output={log_dir}/slurm-%j.out
set -euo pipefail

{exports}
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MASTER_ADDR
export MASTER_PORT="${{MASTER_PORT:-{RDZV_PORT}}}"
export RDZV_ID="$SLURM_JOB_ID"
{f'mkdir -p "${targets.NEFF_CACHE_ENV}"' if spec.target == "trn2" else ""}

# Quoted heredoc: ${{MASTER_ADDR}} and friends expand on each node, not here.
NODE_CMD="$(cat <<'NODE'
cd {shlex.quote(workdir)} && exec {node_command(spec, python, run_json)}
NODE
)"
srun --kill-on-bad-exit=1 --ntasks-per-node=1 {runtime}bash -c "$NODE_CMD"
"""
    return {"train.sbatch": script, "run.json": json.dumps(spec.to_dict(), indent=2) + "\n"}


def render_eks(plan_: LaunchPlan) -> dict[str, str]:
    import yaml

    spec = plan_.spec
    name = f"qwen3-{spec.model_key.lower()}-{spec.path}".replace("_", "-").replace(".", "-")[:50].strip("-")
    labels = {"app.kubernetes.io/name": name}
    env = {**_env_lines(plan_), "MASTER_ADDR": f"{name}-0.{name}", "MASTER_PORT": str(RDZV_PORT), "RDZV_ID": name}
    resources = {"aws.amazon.com/neuron": NEURON_DEVICES_PER_NODE, "vpc.amazonaws.com/efa": EFA_DEVICES_PER_NODE}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-run", "labels": labels},
                  "data": {"run.json": json.dumps(spec.to_dict(), indent=2)}}
    # Headless, and publishing not-ready pods: every pod must resolve <name>-0 before any is ready.
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels,
                        "ports": [{"name": "rendezvous", "port": RDZV_PORT}]}}
    container = {
        "name": "trainer", "image": plan_.image, "workingDir": IMAGE_WORKDIR,
        "command": ["bash", "-c", node_command(spec, IMAGE_PYTHON, RUN_JSON_IN_POD)],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},  # EFA pins memory
        "volumeMounts": [{"name": "checkpoints", "mountPath": plan_.cluster_checkpoints},
                         {"name": "run", "mountPath": str(Path(RUN_JSON_IN_POD).parent)},
                         {"name": "shm", "mountPath": "/dev/shm"}],
    }
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
        "spec": {
            "completionMode": "Indexed", "completions": plan_.nodes, "parallelism": plan_.nodes, "backoffLimit": 0,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "subdomain": name, "restartPolicy": "Never",
                    "nodeSelector": {"node.kubernetes.io/instance-type": "trn2.48xlarge"},
                    "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                        {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}]}},
                    "containers": [container],
                    "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": plan_.pvc}},
                                {"name": "run", "configMap": {"name": f"{name}-run"}},
                                {"name": "shm", "emptyDir": {"medium": "Memory"}}],
                },
            },
        },
    }
    if spec.target != "trn2":  # CPU nodes (the rehearsal): no Neuron devices, EFA or trn2 instance type
        del container["resources"], container["securityContext"], job["spec"]["template"]["spec"]["nodeSelector"]
    for doc in (config_map, service, job):
        doc["metadata"]["namespace"] = plan_.namespace
    text = "# Rendered by `python -m pipeline launch --scheduler eks`. Apply: kubectl apply -f job.yaml\n"
    return {"job.yaml": text + yaml.safe_dump_all([config_map, service, job], sort_keys=False)}


def run(args: argparse.Namespace) -> dict[str, Path]:
    plan_ = plan(args)
    rendered = render_slurm(plan_) if plan_.scheduler == "slurm" else render_eks(plan_)
    plan_.output.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, text in rendered.items():
        path = plan_.output / name
        path.write_text(text)
        if name.endswith(".sbatch"):
            path.chmod(0o755)
        written[name] = path
        print(f"wrote {path}")
    return written
