"""The rendered sbatch on a real Slurm (tests/local_slurm.py: slurmctld, two slurmd "nodes" on this host,
munge, all on 127.0.0.1): tiny trains on the CPU target through srun and torchrun's c10d rendezvous, one
rank per node; a job cancelled mid-run (scancel) and submitted again resumes from the last complete
checkpoint with the losses of an uninterrupted job."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from helpers import read_metrics, run_pipeline
from local_slurm import NODES, PARTITION, LocalSlurm, ensure_installed

pytestmark = pytest.mark.slow
STEPS = 4
CANCEL_AFTER_STEP = 2  # a checkpoint every step (the test's CONFIG): step 1 or 2 is the last complete one


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = ensure_installed()
    if why:
        pytest.skip(f"no local Slurm: {why}")
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as running:
        yield running


def render(root: Path, name: str) -> tuple[Path, Path]:
    """`launch --scheduler slurm` as a user renders it for this cluster: the venv runtime, the partition,
    an account and time limit, the run under the shared checkpoints root; a CONFIG checkpointing each step."""
    config = root / "every-step.toml"
    config.write_text("[train]\ncheckpoint_interval = 1\n")
    out, run_dir = root / "launch" / name, root / "runs" / name
    run_pipeline("launch", "--scheduler", "slurm", "--nodes", str(len(NODES)), "--model", "tiny", "--target", "cpu",
                 "--nproc-per-node", "1", "--runtime", "venv", "--steps", str(STEPS), "--config", str(config),
                 "--partition", PARTITION, "--account", "pipeline-tests", "--time-limit", "00:20:00",
                 "--cluster-checkpoints", str(root), "--run-dir", str(run_dir), "--output", str(out), root=root)
    return out / "train.sbatch", run_dir


def job_output(script: Path, job: str) -> str:
    return (script.parent / f"slurm-{job}.out").read_text(errors="replace")


def test_sbatch_trains_on_two_nodes_and_resumes_after_scancel(cluster, tiny_root):
    # An uninterrupted job: the reference.
    script, reference_dir = render(tiny_root, "reference")
    text = script.read_text()
    for line in (f"#SBATCH --partition={PARTITION}", "#SBATCH --account=pipeline-tests", "#SBATCH --time=00:20:00",
                 "#SBATCH --requeue", f"#SBATCH --output={script.parent}/slurm-%j.out"):
        assert line in text
    job = cluster.sbatch(script)
    assert cluster.wait(job) == "COMPLETED", job_output(script, job)[-3000:] + cluster.logs()
    reference = read_metrics(reference_dir)
    assert [m["step"] for m in reference] == list(range(1, STEPS + 1))
    # One world over the two nodes: each node's torchrun logged under its own node dir, 2 ranks' batches.
    assert sorted(p.name for p in (reference_dir / "logs").iterdir()) == ["node-0", "node-1"]
    assert len(list((reference_dir / "first_batch").glob("rank*.safetensors"))) == len(NODES)
    spec = json.loads((script.parent / "run.json").read_text())
    assert spec["settings"]["nnodes"] == len(NODES) and spec["settings"]["checkpoint_interval"] == 1

    # The same run, cancelled once step CANCEL_AFTER_STEP is logged, then submitted again.
    script, run_dir = render(tiny_root, "cancelled")
    first = cluster.sbatch(script)
    deadline = time.monotonic() + 600
    seen = 0
    while time.monotonic() < deadline and cluster.state(first) in ("PENDING", "RUNNING", "CONFIGURING"):
        if (run_dir / "metrics.jsonl").exists():
            seen = max((m["step"] for m in read_metrics(run_dir)), default=0)
            if seen >= CANCEL_AFTER_STEP:
                cluster.scancel(first)
                break
        time.sleep(0.2)
    assert seen >= CANCEL_AFTER_STEP, f"job {first} ended ({cluster.state(first)}) before step {CANCEL_AFTER_STEP}"
    assert cluster.wait(first) == "CANCELLED"
    assert not (run_dir / "checkpoint" / f"step-{STEPS}" / ".metadata").exists(), "the cancel landed after the last save"
    completed = sorted(int(p.parent.name.removeprefix("step-")) for p in (run_dir / "checkpoint").glob("step-*/.metadata"))
    assert completed, "no checkpoint was complete when the job was cancelled"

    second = cluster.sbatch(script)
    assert cluster.wait(second) == "COMPLETED", job_output(script, second)[-3000:]
    log = job_output(script, second)
    assert f"Loading the checkpoint from {run_dir}/checkpoint/step-{completed[-1]}" in log, log[-3000:]
    assert f"Training starts at step {completed[-1] + 1}" in log
    assert (script.parent / f"slurm-{first}.out").exists()  # one output file per job
    resumed = read_metrics(run_dir)
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in resumed] == [m["loss"] for m in reference], f"cancelled after step {seen}"
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in reference]
