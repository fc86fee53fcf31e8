"""Multi-node launch files (stage `launch`); torchrun does the launching, never this code.

`--scheduler slurm` writes an sbatch script, `--scheduler eks` Kubernetes manifests (a
ConfigMap with run.json, a headless Service for the rendezvous, an Indexed Job with one pod
per node). Both run the exact torchrun command `train` would, with c10d rendezvous on the
first node and the EFA environment. The model must already be downloaded under the cluster's
checkpoints directory, a filesystem every node shares; a dataset that is staged (DATASET=c4:
pipeline.data.staged) is staged there by the launch files, once, before any rank starts (the
sbatch script's first step, the EKS staging job).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline import envvars
from pipeline.errors import PipelineError
from pipeline.flags import flag
from pipeline.fsutil import atomic_write_text
from pipeline.launch import pushed, torchrun
from pipeline.launch.image import IMAGE, default_tag
from pipeline.run import rundir, store, targets
from pipeline.run.spec import RunSpec
from pipeline.training.memory import host_need
from pipeline.training.resolve import RunRequest, resolve

# Libfabric over EFA with GPU/Neuron-direct RDMA; fork-safe because torchrun forks ranks.
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
# Per target, what a node needs beyond the target's own launch environment. trn2 nodes talk over
# EFA; CPU nodes (the rehearsal of these files, `make rehearse`) over TCP with gloo.
LAUNCH_ENV = {"trn2": EFA_ENV, "cpu": {}}
RDZV_PORT = 29500
RUN_JSON_IN_POD = "/etc/pipeline/run.json"
# Hugging Face settings a user's environment gives the launch, written into the launch files so every
# node's huggingface_hub reads the same cache. HF_TOKEN is a secret: never written to a file (the
# sbatch job inherits it from the submitting shell; EKS reads it from a Secret).
HF_PASSED = envvars.HF_SETTINGS
HF_TOKEN_SECRET = "hf-token"  # kubectl create secret generic hf-token --from-literal=token=$HF_TOKEN
# EKS: how many times a failed node's trainer container is restarted (in its pod, same DNS name) before the
# Job gives up, per node; each restart rejoins the rendezvous and resumes from the last complete checkpoint.
RESTARTS_PER_NODE = 3


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
    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None
    job_name: str | None = None
    hf_env: dict | None = None
    efa_devices: int = targets.TRN2.efa_devices
    carried: dict | None = None  # {cluster path: host path}: local DATASET files the staging step copies (slurm)


# The run request's flags as `launch` takes them: a cluster run is trn2's unless told (cpu: the rehearsal's
# nodes), of the native path unless told; FRESH is refused (see plan()).
RUN_FLAGS = {"path": {"default": "native"}, "target": {"default": "trn2", "choices": tuple(LAUNCH_ENV)},
             "fresh": {"hidden": True}}


@dataclass(frozen=True)
class LaunchRequest:
    """What `make launch-slurm` / `launch-eks` (and the rehearsal's two nodes) ask for: the run, as `train`
    would be asked for it (the cluster's run.json is train's dry run), and where and how its nodes run.
    Fields with help are the `launch` stage's flags (pipeline.flags), beside RunRequest's (RUN_FLAGS)."""

    run: RunRequest
    scheduler: str = flag(None, "slurm (an sbatch script) or eks (Kubernetes manifests)", required=True,
                          choices=("slurm", "eks"))
    nodes: int = flag(None, "number of nodes", required=True, make="NODES", make_default="2",
                      make_help='launch-slurm / launch-eks: number of trn2 nodes; rehearse: CPU "nodes" of its two-node '
                                'run (0 skips it)')
    image: str | None = flag(None, "image reference the cluster can pull, by digest (default: what `make push` pushed "
                             "of this lock's image); slurm: or an enroot squashfs file on the shared file system",
                             make="IMAGE", make_default="lock tag")
    runtime: str = flag("pyxis", "slurm: run in the image via pyxis/enroot, or in a venv on the shared filesystem",
                        choices=("pyxis", "venv"), make="RUNTIME")
    venv: str | None = flag(None, "slurm --runtime venv: the venv (default: this repo's .venv)")
    cluster_checkpoints: str | None = flag(None, "checkpoints directory as the nodes see it (default: "
                                           "/fsx/checkpoints for slurm, the image's for eks)",
                                           make="CLUSTER_CHECKPOINTS", make_default="/fsx/checkpoints (eks: /checkpoints)")
    compile_cache: str | None = flag(None, "persistent Neuron compile cache on shared storage")
    namespace: str = flag("default", "eks: the namespace", make="NAMESPACE")
    pvc: str = flag("fsx-claim", "eks: PersistentVolumeClaim holding the checkpoints", make="PVC")
    efa_devices: int = flag(targets.TRN2.efa_devices, "eks: EFA interfaces each trn2 pod requests "
                            "(vpc.amazonaws.com/efa; 0: none, one node only)", make="EFA_DEVICES")
    output: Path | None = flag(None, "where to write (default: checkpoints/<key>/launch/<scheduler>-<N>)", make="LAUNCH_DIR",
                               make_default="checkpoints/<key>/launch/<scheduler>-<NODES>")
    run_dir: str | None = flag(None, "the run's directory as the nodes see it (default: <cluster checkpoints>/<key>/"
                               "runs/<name>)")
    partition: str | None = flag(None, "slurm: sbatch --partition (default: the cluster's default partition)",
                                   make="PARTITION")
    account: str | None = flag(None, "slurm: sbatch --account", make="ACCOUNT")
    time_limit: str | None = flag(None, "slurm: sbatch --time, e.g. 04:00:00 (default: the partition's limit)",
                                    make="TIME_LIMIT")
    job_name: str | None = flag(None, "sbatch --job-name / the Job's name (default: qwen3-<model key>-<run name>)",
                                  make="JOB_NAME", make_default="qwen3-<model>-<run name>")
    local_image_ok: bool = False  # the rehearsal runs the pods' command here: no image is pulled


def plan(request: LaunchRequest) -> LaunchPlan:
    run = request.run
    if request.nodes < 1:
        raise PipelineError(f"NODES={request.nodes} must be at least 1.", "give NODES ≥ 1.")
    if run.fresh:
        raise PipelineError("FRESH=1 with a cluster launch would discard the run's checkpoints on every requeue.",
                            "delete <run dir>/checkpoint on the shared filesystem before submitting instead.")
    if run.target not in LAUNCH_ENV:
        raise PipelineError(f"launch target {run.target!r} has no launch environment.",
                            f"give one of {', '.join(LAUNCH_ENV)}.")
    default_ckpt = "/fsx/checkpoints" if request.scheduler == "slurm" else IMAGE.checkpoints
    cluster_ckpt = request.cluster_checkpoints or default_ckpt
    if not cluster_ckpt.startswith("/"):
        raise PipelineError(f"--cluster-checkpoints {cluster_ckpt!r} is not absolute.", "give an absolute path.")
    for given, value in (("--run-dir", request.run_dir), ("--output", request.output), ("--cluster-checkpoints", cluster_ckpt),
                        ("--compile-cache", request.compile_cache), ("--venv", request.venv), ("--image", request.image)):
        if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in str(value)):
            # A newline would end the script's line (or its heredoc) and start one of its own.
            raise PipelineError(f"{given} {str(value)!r} holds a control character (a newline?).",
                                "give it without newlines or other control characters.")
    # The trn2 run with the paths the nodes see; TP/FSDP checked against the multi-node world.
    spec = resolve(replace(run, flags={**run.flags, "nnodes": request.nodes}, dry_run=True,
                           checkpoints_root=Path(cluster_ckpt),
                           directory=Path(request.run_dir) if request.run_dir else None))
    cluster_home = store.home(run.model, Path(cluster_ckpt))
    if cluster_home.source.kind == "hub":
        # The nodes read the Hub snapshot through <key>/source, the link `make download` leaves under the
        # shared root (this host's HF cache path would mean nothing on them).
        spec.source_dir = str(cluster_home.local_source)
    output = request.output
    if output is None:
        home = store.home(run.model)
        if not run.dry_run:  # a dry run writes nothing; a written launch folder is the pipeline's too (clean)
            store.mark_root(home.root, home.source.key)
        output = home.launch / f"{request.scheduler}-{request.nodes}"
    carried = carry_local_data(spec, request.scheduler, cluster_ckpt, Path(output))
    check_efa_devices(request.efa_devices, request.nodes, run.target)
    needs_image = request.scheduler == "eks" or request.runtime == "pyxis"
    if is_squashfs(request.image):
        image = squashfs_image(request.image, request.scheduler, request.runtime)
    else:
        image = cluster_image(request.image, needs_image and not request.local_image_ok)
    return LaunchPlan(
        scheduler=request.scheduler, nodes=request.nodes, image=image, runtime=request.runtime,
        venv=request.venv or str(store.REPO / ".venv"), cluster_checkpoints=cluster_ckpt,
        compile_cache=request.compile_cache or f"{cluster_ckpt}/.neuron-compile-cache", output=Path(output),
        namespace=request.namespace, pvc=request.pvc, spec=spec, partition=request.partition,
        account=request.account, time_limit=request.time_limit,
        job_name=request.job_name, hf_env=hf_environment(os.environ), efa_devices=request.efa_devices,
        carried=carried)


def cluster_image(given: str | None, required: bool) -> str:
    """The image the nodes pull: pinned by digest, from a registry. Default: what `make push` pushed
    of this lock's image. A local tag would be looked up on Docker Hub by pyxis/kubelet: refused."""
    local = default_tag()
    image = given or pushed.reference(local) or local
    if required and not pushed.is_pinned(image):
        recorded = pushed.reference(image)
        if recorded:  # IMAGE=<the local tag> that was pushed: use its pushed digest
            return recorded
        raise PipelineError(f"image {image!r} is not a registry reference pinned by digest (the nodes cannot pull "
                            "a local tag): push first.",
                            "run `make push REGISTRY=<registry>/<repo>` (launch then uses the pushed digest), or give "
                            "IMAGE=<registry>/<repo>@sha256:<digest>.")
    return image


# ---- Slurm with pyxis: which image references the nodes' enroot reads ----------------------------------
# pyxis passes --container-image to `enroot import docker://<image>` on each node, or uses a squashfs file
# when the value starts with "." or "/" (pyxis_slurmstepd.c). enroot reads REGISTRY/IMAGE@sha256:<digest>
# from 4.0.0 on (2025-10-01, src/docker.sh `_parse_uri`); 3.x takes only [USER@][REGISTRY#]IMAGE[:TAG]
# (doc/cmd/import.md). enroot 3.1-3.5 match a tag against [[:alnum:]._:-]+ and fetch
# /v2/<image>/manifests/<tag> (src/docker.sh v3.1.0-v3.5.0), so a digest given in the tag's place,
# REGISTRY#IMAGE:sha256:<digest>, is the registry's by-digest manifest there: the import command the
# refusal prints keeps the pin.
SQUASHFS_SUFFIXES = (".sqsh", ".squashfs")
ENROOT_DIGEST_MAJOR = 4


def is_squashfs(image: str | None) -> bool:
    return bool(image) and image.endswith(SQUASHFS_SUFFIXES)


def squashfs_image(image: str, scheduler: str, runtime: str) -> str:
    """An enroot squashfs file the nodes read from the shared file system (pyxis only)."""
    if scheduler != "slurm" or runtime != "pyxis":
        raise PipelineError(f"--image {image} is an enroot squashfs file, which only pyxis on Slurm reads.",
                            "give IMAGE=<registry>/<repo>@sha256:<digest> (or RUNTIME=pyxis with launch-slurm).")
    if not image.startswith("/"):
        raise PipelineError(f"--image {image} is a relative path; each node resolves it in its own working directory.",
                            "give the squashfs file's absolute path on the shared file system.")
    return image


def enroot_import_command(plan_: LaunchPlan) -> str:
    """`enroot import` of the plan's image into a squashfs file beside the checkpoints, in the form enroot
    3.x reads (REGISTRY#IMAGE:sha256:<digest>, see above)."""
    repository, digest = plan_.image.split("@", 1)
    registry, name = repository.split("/", 1)
    target = f"{plan_.cluster_checkpoints}/images/{name.replace('/', '-')}-{digest.removeprefix('sha256:')[:12]}.sqsh"
    return f"enroot import --output {shlex.quote(target)} {shlex.quote(f'docker://{registry}#{name}:{digest}')}"


def image_check(plan_: LaunchPlan) -> str:
    """sbatch lines that stop the job in one line, before srun, when the nodes cannot read the image."""
    if plan_.runtime != "pyxis" or not (is_squashfs(plan_.image) or pushed.is_pinned(plan_.image)):
        return ""  # a venv, or the rehearsal's local image (nothing is pulled)
    image = shlex.quote(plan_.image)
    if is_squashfs(plan_.image):
        return (f'[ -r {image} ] || {{ echo "error: the image file {_double_quoted(plan_.image)} is not readable on '
                '$(hostname). Fix: import it once to the shared file system every node mounts (enroot import --output '
                '<file>.sqsh docker://…), or pass IMAGE=<registry>/<repo>@sha256:<digest>." >&2; exit 2; }\n')
    fix = (f"import it once to the shared file system, {enroot_import_command(plan_)}, then render with "
           f"make launch-slurm IMAGE=<that .sqsh file> (or install enroot 4 or newer on the nodes)")
    return (f"# pyxis hands {plan_.image} to enroot, which reads digest references from {ENROOT_DIGEST_MAJOR}.0 on.\n"
            'ENROOT_VERSION="$(enroot version 2>/dev/null || true)"\n'
            'case "$ENROOT_VERSION" in\n'
            f'  ""|[0-{ENROOT_DIGEST_MAJOR - 1}].*)\n'
            f'    echo "error: enroot ${{ENROOT_VERSION:-(none on PATH)}} on $(hostname) cannot pull {plan_.image} '
            f'(a digest reference needs enroot {ENROOT_DIGEST_MAJOR}.0 or newer). Fix: {_double_quoted(fix)}" >&2\n'
            "    exit 2 ;;\nesac\n")


def _double_quoted(text: str) -> str:
    """Text safe inside a double-quoted bash string."""
    return "".join("\\" + c if c in '"$`\\' else c for c in text)


def hf_environment(environ) -> dict:
    return {k: environ[k] for k in HF_PASSED if environ.get(k)}


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
    network = LAUNCH_ENV[target] if plan_.efa_devices > 0 else {}
    return {**sized, **network, **cache, **(plan_.hf_env or {}),
            envvars.CHECKPOINTS: plan_.cluster_checkpoints, "PYTHONUNBUFFERED": "1"}


def job_name(plan_: LaunchPlan) -> str:
    """JOB_NAME, or qwen3-<model key>-<run name>: two runs of one path (sft and dpo on native) are two jobs."""
    return plan_.job_name or f"qwen3-{plan_.spec.model_key}-{Path(plan_.spec.run_dir).name}"


def kubernetes_name(name: str) -> str:
    """`name` as a Kubernetes object name (RFC 1123 label: lower-case letters, digits and '-'), short enough for
    the StatefulSet's pod names and the `-run` ConfigMap beside it."""
    label = re.sub(r"[^a-z0-9-]+", "-", name.lower())[:50].strip("-")
    if not label:
        raise PipelineError(f"JOB_NAME={name!r} has no letter or digit to name the Kubernetes objects with.",
                            "give JOB_NAME letters or digits (e.g. JOB_NAME=team-a-sft), or leave it out.")
    return label


def sbatch_options(plan_: LaunchPlan) -> list[str]:
    """The #SBATCH lines: the job's name, size, where it may run and for how long, and its log per job."""
    spec = plan_.spec
    # Requeue (after a node failure, a preemption, `scontrol requeue`) resumes from the last complete
    # checkpoint only when the run writes checkpoints; without them a requeue would start over.
    resumable = spec.settings.checkpoint_interval > 0
    options = [f"--job-name={job_name(plan_)}",
               f"--nodes={plan_.nodes}", "--ntasks-per-node=1", "--exclusive",
               f"--output={plan_.output}/slurm-%j.out", "--requeue" if resumable else "--no-requeue"]
    for sbatch_option, value in (("partition", plan_.partition), ("account", plan_.account), ("time", plan_.time_limit)):
        if value:
            options.append(f"--{sbatch_option}={value}")
    return [f"#SBATCH {shlex.quote(option)}" for option in options]


def data_staging(spec: RunSpec) -> list[str]:
    """The `data` stage's arguments that stage the run's dataset onto the shared root (nothing for data
    the model's own `make data` wrote there)."""
    if spec.data_kind == "staged":
        return ["--dataset", spec.settings.dataset]
    return []


CARRIED = "data"  # <launch folder>/data/: a local DATASET's files, carried to the nodes with the sbatch script


def carry_local_data(spec: RunSpec, scheduler: str, cluster_ckpt: str, output: Path) -> dict[str, str]:
    """A local DATASET file (and its held-out file) is a path on this host, which no node has: the run reads
    it at <cluster root>/data/carried/<stem>-<sha12>/<name> instead (apart from data/sets, whose split folders
    `make data` replaces whole), copied there by the staging step from the launch folder (which the nodes mount:
    they read run.json there). {cluster path: host path}. EKS pods mount only the volume: refused in one line
    naming how to put it there."""
    from pipeline.checkpoint import manifest

    carried = {}
    for name in ("data_file", "eval_file"):
        host = getattr(spec, name)
        if spec.data_kind != "file" or not host or Path(host).is_relative_to(cluster_ckpt):
            continue
        if scheduler == "eks":
            raise PipelineError(f"DATASET={spec.settings.dataset} is read from {host}, a file on this host; the EKS pods "
                                "mount only the checkpoints volume.",
                                "copy the file onto that volume (e.g. kubectl cp into a pod that mounts it) and give "
                                "DATASET=<its path under CLUSTER_CHECKPOINTS>, or launch with launch-slurm.")
        digest = manifest.sha256(Path(host))
        cluster = f"{cluster_ckpt}/data/carried/{Path(host).stem}-{digest[:12]}/{Path(host).name}"
        carried[cluster] = host
        setattr(spec, name, cluster)
        if name == "data_file":  # DATASET itself names the file the nodes read
            spec.settings = dataclasses.replace(spec.settings, dataset=cluster)
    return carried


def carried_name(cluster_path: str) -> str:
    return f"{Path(cluster_path).parent.name}-{Path(cluster_path).name}"


def staging_commands(plan_: LaunchPlan, python: str) -> list[str]:
    """Shell commands that put the run's data on the shared root: the data stage for a staged set, and a
    checked copy of each file carried in the launch folder (sha256 verified before it is moved into place)."""
    commands = []
    staging = data_staging(plan_.spec)
    if staging:
        commands.append(shlex.join([python, "-m", "pipeline", "data", "--model", plan_.spec.model, *staging]))
    from pipeline.checkpoint import manifest

    for cluster, host in sorted((plan_.carried or {}).items()):
        source, part = str(plan_.output / CARRIED / carried_name(cluster)), f"{cluster}.part"
        check = f"{manifest.sha256(Path(host))}  {part}"
        commands.append(f"mkdir -p {shlex.quote(str(Path(cluster).parent))} && cp {shlex.quote(source)} "
                        f"{shlex.quote(part)} && echo {shlex.quote(check)} | sha256sum -c --quiet && "
                        f"mv {shlex.quote(part)} {shlex.quote(cluster)}")
    return commands


def slurm_staging_step(plan_: LaunchPlan, runtime: str, python: str, workdir: str) -> str:
    """One task on one node stages the data before the ranks' srun (the ranks then only read it)."""
    commands = staging_commands(plan_, python)
    if not commands:
        return ""
    return f"""# The training data, staged once onto the shared file system before any rank starts.
STAGE_CMD="$(cat <<'STAGE'
cd {shlex.quote(workdir)} && {" && ".join(commands)}
STAGE
)"
srun --nodes=1 --ntasks=1 {runtime}bash -c "$STAGE_CMD"
"""


def render_slurm(plan_: LaunchPlan) -> dict[str, str]:
    spec = plan_.spec
    run_json = str(plan_.output / rundir.RUN_JSON)
    if plan_.runtime == "pyxis":
        mounts = ",".join(sorted({f"{plan_.cluster_checkpoints}:{plan_.cluster_checkpoints}",
                                  f"{plan_.compile_cache}:{plan_.compile_cache}", f"{plan_.output}:{plan_.output}"}))
        runtime = (f"--container-image={shlex.quote(plan_.image)} --container-mounts={shlex.quote(mounts)} "
                   f"--container-workdir={IMAGE.workdir} --no-container-entrypoint ")
        python, workdir = IMAGE.python, IMAGE.workdir
    else:
        runtime, python, workdir = "", f"{plan_.venv}/bin/python", str(store.REPO)
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in _env_lines(plan_).items())
    options = "\n".join(sbatch_options(plan_))
    script = f"""#!/bin/bash
# Rendered by `python -m pipeline launch --scheduler slurm` for {spec.model_key} ({spec.path} path).
# One task per node; torchrun on each starts {spec.settings.nproc_per_node} ranks and meets the others through
# c10d rendezvous on the first node. Submit with: sbatch {plan_.output / "train.sbatch"}
# HF_TOKEN, when the run needs one, comes from the submitting shell's environment (sbatch exports it);
# it is never written here.
{options}
set -euo pipefail

{exports}
# The first node's address as Slurm knows it (NodeAddr; its hostname where NodeAddr is unset).
MASTER_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_ADDR="$(scontrol show node "$MASTER_NODE" -o | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')"
export MASTER_ADDR="${{MASTER_ADDR:-$MASTER_NODE}}"
export MASTER_PORT="${{MASTER_PORT:-{RDZV_PORT}}}"
export RDZV_ID="$SLURM_JOB_ID"
{f'mkdir -p "${targets.NEFF_CACHE_ENV}"' if spec.target == "trn2" else ""}
{image_check(plan_)}
# Quoted heredoc: ${{MASTER_ADDR}} and friends expand on each node, not here.
NODE_CMD="$(cat <<'NODE'
cd {shlex.quote(workdir)} && exec {node_command(spec, python, run_json)}
NODE
)"
{slurm_staging_step(plan_, runtime, python, workdir)}srun --kill-on-bad-exit=1 --ntasks-per-node=1 {runtime}bash -c "$NODE_CMD"
"""
    return {"train.sbatch": script, rundir.RUN_JSON: spec.to_json()}


def render_eks(plan_: LaunchPlan) -> dict[str, str]:
    import yaml

    spec = plan_.spec
    name = kubernetes_name(job_name(plan_))
    labels = {"app.kubernetes.io/name": name}
    env = {**_env_lines(plan_), "MASTER_ADDR": f"{name}-0.{name}", "MASTER_PORT": str(RDZV_PORT), "RDZV_ID": name}
    # HF_TOKEN from a Secret (never in the manifest); optional: public models need none.
    token = {"name": envvars.HF_TOKEN, "valueFrom": {"secretKeyRef": {"name": HF_TOKEN_SECRET, "key": "token",
                                                                 "optional": True}}}
    resources = trn2_resources(plan_.efa_devices)
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-run", "labels": labels},
                  "data": {rundir.RUN_JSON: spec.to_json()}}
    # Headless, and publishing not-ready pods: every pod must resolve <name>-0 before any is ready.
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels,
                        "ports": [{"name": "rendezvous", "port": RDZV_PORT}]}}
    container = {
        "name": "trainer", "image": plan_.image, "workingDir": IMAGE.workdir,
        "command": ["bash", "-c", node_command(spec, IMAGE.python, RUN_JSON_IN_POD)],
        "env": [{"name": k, "value": v} for k, v in env.items()] + [token],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}, **IMAGE_USER},  # EFA pins memory
        "volumeMounts": [{"name": "checkpoints", "mountPath": plan_.cluster_checkpoints},
                         {"name": "run", "mountPath": str(Path(RUN_JSON_IN_POD).parent)},
                         {"name": "shm", "mountPath": "/dev/shm"}],
    }
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": labels},
        "spec": {
            # A failed trainer restarts in its pod (OnFailure: same pod, same DNS name for the rendezvous) and
            # resumes from the run's last complete checkpoint on the shared volume, up to backoffLimit times.
            "completionMode": "Indexed", "completions": plan_.nodes, "parallelism": plan_.nodes,
            "backoffLimit": RESTARTS_PER_NODE * plan_.nodes,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "subdomain": name, "restartPolicy": "OnFailure",
                    "nodeSelector": {"node.kubernetes.io/instance-type": "trn2.48xlarge"},
                    "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                        {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}]}},
                    "securityContext": pod_security_context(),
                    "initContainers": [volume_owner_step(plan_)],
                    "containers": [container],
                    "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": plan_.pvc}},
                                {"name": "run", "configMap": {"name": f"{name}-run"}},
                                {"name": "shm", "emptyDir": {"medium": "Memory"}}],
                },
            },
        },
    }
    if spec.target != "trn2":  # CPU nodes (the rehearsal): no Neuron devices, EFA or trn2 instance type
        del container["resources"], job["spec"]["template"]["spec"]["nodeSelector"]
        container["securityContext"] = dict(IMAGE_USER)
    for doc in (config_map, service, job):
        doc["metadata"]["namespace"] = plan_.namespace
    text = "# Rendered by `python -m pipeline launch --scheduler eks`. Apply: kubectl apply -f job.yaml\n"
    stage = staging_job(plan_, name, labels, token)
    stage_text = ("# Stages the model and the training data on the shared volume before job.yaml runs:\n"
                  "#   kubectl apply -f stage.yaml && kubectl wait --for=condition=complete job/" + name + "-stage\n")
    return {"job.yaml": text + yaml.safe_dump_all([config_map, service, job], sort_keys=False),
            "stage.yaml": stage_text + yaml.safe_dump(stage, sort_keys=False)}


def staging_job(plan_: LaunchPlan, name: str, labels: dict, token: dict) -> dict:
    """One pod that runs `download` and `data` in the image onto the shared volume: what the nodes read."""
    spec = plan_.spec
    steps = [[IMAGE.python, "-m", "pipeline", "download", "--model", spec.model],
             [IMAGE.python, "-m", "pipeline", "data", "--model", spec.model, *data_staging(spec)]]
    # The Hub cache on the volume unless HF_HOME says otherwise: the image's own /hf-cache dies with the pod.
    env = {envvars.CHECKPOINTS: plan_.cluster_checkpoints, "PYTHONUNBUFFERED": "1",
           "HF_HOME": f"{plan_.cluster_checkpoints}/.hf-home", **(plan_.hf_env or {})}
    container = {"name": "stage", "image": plan_.image, "workingDir": IMAGE.workdir,
                 "command": ["bash", "-c", " && ".join(shlex.join(step) for step in steps)],
                 "env": [{"name": k, "value": v} for k, v in env.items()] + [token],
                 "securityContext": dict(IMAGE_USER),
                 "volumeMounts": [{"name": "checkpoints", "mountPath": plan_.cluster_checkpoints}]}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"{name}-stage", "labels": labels, "namespace": plan_.namespace},
            "spec": {"backoffLimit": 2, "template": {"metadata": {"labels": labels}, "spec": {
                "restartPolicy": "OnFailure", "securityContext": pod_security_context(),
                "initContainers": [volume_owner_step(plan_)], "containers": [container],
                "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": plan_.pvc}}]}}}}


# ---- EKS: the pods' user on the shared volume, and the devices they request ----------------------------
# The image's user, by number (the Dockerfile: the base's UID-1000 user, Ubuntu's `ubuntu`, whose group is
# 1000 too): named in the pod so the kubelet, not the image's USER line, decides who the trainer is.
IMAGE_USER = {"runAsUser": IMAGE.uid, "runAsGroup": IMAGE.uid, "runAsNonRoot": True}


def pod_security_context() -> dict:
    """fsGroup makes the volume group-writable for the image's user where the CSI driver applies it. The FSx
    for Lustre driver's CSIDriver has kept the default fsGroupPolicy (ReadWriteOnceWithFSType, kubernetes-sigs/
    aws-fsx-csi-driver#348 was closed unmerged), which skips ReadWriteMany volumes: hence volume_owner_step."""
    return {"fsGroup": IMAGE.uid, "fsGroupChangePolicy": "OnRootMismatch"}


def volume_owner_step(plan_: LaunchPlan) -> dict:
    """An init step, as root, that gives a root-owned volume's top directory (a fresh FSx file system's) to
    the image's user, whatever the CSI driver does with fsGroup. Only that directory, not recursively:
    everything below it is written by the pipeline as that user, and a volume holding earlier runs has
    millions of files. A namespace that enforces the "restricted" Pod Security Standard refuses a root
    container: there, chown the directory once by hand (docs/trn2.md)."""
    root, owner = plan_.cluster_checkpoints, f"{IMAGE.uid}:{IMAGE.uid}"
    script = (f'd={shlex.quote(root)}; if [ "$(stat -c %u:%g "$d")" != {owner} ]; then '
              f'chown {owner} "$d" && chmod u+rwx "$d" && echo "gave $d to {owner}"; fi')
    return {"name": "volume-owner", "image": plan_.image, "command": ["sh", "-c", script],
            "securityContext": {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False},
            "volumeMounts": [{"name": "checkpoints", "mountPath": root}]}


def trn2_resources(efa_devices: int) -> dict:
    """Every Neuron device of the node, and the EFA interfaces asked for (none: no EFA resource)."""
    resources = {"aws.amazon.com/neuron": targets.TRN2.chips}
    if efa_devices > 0:
        resources["vpc.amazonaws.com/efa"] = efa_devices
    return resources


def check_efa_devices(efa_devices: int, nodes: int, target: str) -> None:
    if efa_devices < 0:
        raise PipelineError(f"EFA_DEVICES={efa_devices} is negative.", f"give 0 to {targets.TRN2.efa_devices}.")
    if efa_devices == 0 and nodes > 1 and target == "trn2":
        raise PipelineError(f"EFA_DEVICES=0 with NODES={nodes}: trn2 nodes exchange collectives over EFA.",
                            f"request the node's EFA interfaces (trn2.48xlarge: {targets.TRN2.efa_devices}), or NODES=1.")


def render(plan_: LaunchPlan) -> dict[str, str]:
    return render_slurm(plan_) if plan_.scheduler == "slurm" else render_eks(plan_)


def write(plan_: LaunchPlan, rendered: dict[str, str]) -> dict[str, Path]:
    """Each rendered file under the plan's output, atomically (the sbatch script executable)."""
    plan_.output.mkdir(parents=True, exist_ok=True)
    written = {}
    for cluster, host in sorted((plan_.carried or {}).items()):  # what the staging step copies onto the shared root
        carried = plan_.output / CARRIED / carried_name(cluster)
        carried.parent.mkdir(exist_ok=True)
        shutil.copyfile(host, f"{carried}.tmp")
        os.replace(f"{carried}.tmp", carried)
        print(f"carried {host} → {carried} (staged to {cluster} before the ranks start)")
    for name, text in rendered.items():
        path = plan_.output / name
        atomic_write_text(path, text)
        if name.endswith(".sbatch"):
            path.chmod(0o755)
        written[name] = path
        print(f"wrote {path}")
    return written
