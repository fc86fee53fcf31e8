"""`make launch-slurm` / `make launch-eks` resolve the run exactly as `make train-* DRY_RUN=1` does for
the same variables (CONFIG, STEPS, SEQ_LEN, DATASET, TITAN_ARGS, TRAIN_PATH…): the cluster's run.json is
the dry run's, with the cluster's checkpoints root and node count. Through make itself, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers import REPO, dry_run_spec
from pipeline.launch.cluster import carried_name

# Everything a user may give train-*, each away from its default so a dropped one shows.
VARIABLES = ("MODEL=tiny", "TARGET=cpu", "TRAIN_PATH=native", "STEPS=7", "SEQ_LEN=64", "NPROC=1",
             "TITAN_ARGS=--lr-scheduler.warmup-steps 1 --training.max-norm 0.5")
# Each make here starts the pipeline (imports torch): ~20 s apiece on a loaded 2-core machine.
pytestmark = pytest.mark.slow


def make(*args: str, root) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    # -o: never rebuild the shared venv from here.
    result = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", *args,
                             f"PIPELINE_CHECKPOINTS={root}"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


@pytest.fixture
def user_inputs(tmp_path):
    config = tmp_path / "mine.toml"
    config.write_text('[train]\nlr = 3e-4\ncheckpoint_interval = 3\nlocal_batch_size = 1\n')
    data = tmp_path / "mydata.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} of my data"}) + "\n" for i in range(50)))
    return (*VARIABLES, f"CONFIG={config}", f"DATASET={data}")


def test_launch_slurm_run_json_is_train_dry_run(tmp_path, user_inputs):
    root = tmp_path / "ckpt"
    dry = dry_run_spec(make("train-native", "DRY_RUN=1", *user_inputs, root=root).stdout)
    # What the dry run resolved is what the user asked for (so equality below is not of two defaults).
    assert dry["settings"]["steps"] == 7 and dry["settings"]["seq_len"] == 64 and dry["settings"]["lr"] == 3e-4
    assert dry["settings"]["checkpoint_interval"] == 3 and dry["data_file"] == user_inputs[-1].split("=", 1)[1]
    assert dry["titan_args"] == ["--lr-scheduler.warmup-steps", "1", "--training.max-norm", "0.5"]

    one = tmp_path / "one"
    make("launch-slurm", "NODES=1", "RUNTIME=venv", f"CLUSTER_CHECKPOINTS={root}", f"LAUNCH_DIR={one}",
         *user_inputs, root=root)
    launched = json.loads((one / "run.json").read_text())
    # The local DATASET is a path on this host: the run reads the copy carried in the launch folder, which the
    # staging step puts under the cluster root; apart from that path, the run is the dry run.
    carried = launched["data_file"]
    assert carried.startswith(f"{root}/data/carried/mydata-") and carried.endswith("/mydata.jsonl")
    assert launched["settings"]["dataset"] == carried
    assert (one / "data" / carried_name(carried)).read_bytes() == Path(dry["data_file"]).read_bytes()
    assert launched == json.loads(json.dumps(dry).replace(f'"{dry["data_file"]}"', f'"{carried}"'))

    # Two nodes on the cluster's filesystem: the same run, its paths under /fsx, one world over two nodes.
    two = tmp_path / "two"
    make("launch-slurm", "NODES=2", "RUNTIME=venv", "CLUSTER_CHECKPOINTS=/fsx/ckpt", f"LAUNCH_DIR={two}",
         *user_inputs, root=root)
    cluster = json.loads((two / "run.json").read_text())
    expected = json.loads(json.dumps(dry).replace(f'"{dry["data_file"]}"', f'"{carried}"').replace(f'"{root}/', '"/fsx/ckpt/'))
    expected["settings"]["nnodes"] = 2
    cluster.pop("memory"), expected.pop("memory")  # the estimate sees the two-node world
    assert cluster == expected
    assert cluster["run_dir"] == "/fsx/ckpt/tiny/runs/native" and cluster["source_dir"] == "/fsx/ckpt/tiny/source"


def test_launch_eks_run_json_is_train_dry_run(tmp_path, user_inputs):
    root = tmp_path / "ckpt"
    image = "registry.example/qwen3@sha256:" + "a" * 64
    # A DATASET on this host is refused for EKS (its pods mount only the checkpoints volume), naming the fix …
    refused = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "launch-eks", "NODES=1",
                              f"IMAGE={image}", f"CLUSTER_CHECKPOINTS={root}", f"LAUNCH_DIR={tmp_path / 'no'}",
                              *user_inputs, f"PIPELINE_CHECKPOINTS={root}"], cwd=REPO, capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")},
                             timeout=300)
    assert refused.returncode != 0 and "the EKS pods mount only the checkpoints volume" in refused.stderr
    assert not (tmp_path / "no").exists()
    # … and one already on the volume is the run the dry run resolves.
    on_volume = root / "mydata.jsonl"
    root.mkdir(exist_ok=True)
    on_volume.write_bytes(Path(user_inputs[-1].split("=", 1)[1]).read_bytes())
    inputs = (*user_inputs[:-1], f"DATASET={on_volume}")
    dry = dry_run_spec(make("train-native", "DRY_RUN=1", *inputs, root=root).stdout)
    assert dry["data_file"] == str(on_volume)
    out = tmp_path / "eks"
    make("launch-eks", "NODES=1", f"IMAGE={image}", f"CLUSTER_CHECKPOINTS={root}", f"LAUNCH_DIR={out}",
         *inputs, root=root)
    docs = {d["kind"]: d for d in yaml.safe_load_all((out / "job.yaml").read_text())}
    assert json.loads(docs["ConfigMap"]["data"]["run.json"]) == dry


def test_launch_options_reach_the_sbatch(tmp_path):
    root, out = tmp_path / "ckpt", tmp_path / "o"
    make("launch-slurm", "MODEL=tiny", "TARGET=cpu", "NODES=2", "RUNTIME=venv", f"LAUNCH_DIR={out}",
         "PARTITION=trn2", "ACCOUNT=ml-team", "TIME_LIMIT=04:00:00", "JOB_NAME=my-run", root=root)
    lines = [line for line in (out / "train.sbatch").read_text().splitlines() if line.startswith("#SBATCH")]
    assert lines == ["#SBATCH --job-name=my-run", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                     "#SBATCH --exclusive", f"#SBATCH --output={out}/slurm-%j.out", "#SBATCH --requeue",
                     "#SBATCH --partition=trn2", "#SBATCH --account=ml-team", "#SBATCH --time=04:00:00"]


def test_each_run_is_a_job_of_its_own_named_after_it(tmp_path):
    """Two runs of one path (RUN_NAME=sft and RUN_NAME=dpo on native) were one job name, so the second EKS apply
    replaced the first's objects; JOB_NAME reached the sbatch only."""
    root = tmp_path / "ckpt"
    image = "registry.example/qwen3@sha256:" + "a" * 64
    names = {}
    for run, given in (("sft", None), ("dpo", None), ("dpo", "Team_A.dpo")):
        out = tmp_path / f"{run}-{given}"
        extra = [f"RUN_NAME={run}"] + ([f"JOB_NAME={given}"] if given else [])
        make("launch-slurm", "MODEL=tiny", "TARGET=cpu", "NODES=2", "RUNTIME=venv", f"LAUNCH_DIR={out}/slurm", *extra,
             root=root)
        make("launch-eks", "MODEL=tiny", "TARGET=cpu", "NODES=2", f"IMAGE={image}", f"CLUSTER_CHECKPOINTS={root}",
             f"LAUNCH_DIR={out}/eks", *extra, root=root)
        sbatch = (out / "slurm" / "train.sbatch").read_text()
        docs = list(yaml.safe_load_all((out / "eks" / "job.yaml").read_text()))
        names[run, given] = (sbatch.split("#SBATCH --job-name=")[1].split("\n")[0],
                             {d["kind"]: d["metadata"]["name"] for d in docs})
    assert names["sft", None][0] == "qwen3-tiny-sft" and names["dpo", None][0] == "qwen3-tiny-dpo"
    assert names["sft", None][1]["ConfigMap"] == "qwen3-tiny-sft-run"
    assert set(names["sft", None][1].values()).isdisjoint(names["dpo", None][1].values())
    assert names["dpo", "Team_A.dpo"][0] == "Team_A.dpo"
    assert names["dpo", "Team_A.dpo"][1]["ConfigMap"] == "team-a-dpo-run"  # an RFC 1123 name of JOB_NAME
    from pipeline.errors import PipelineError
    from pipeline.launch.cluster import kubernetes_name

    with pytest.raises(PipelineError, match="no letter or digit"):
        kubernetes_name("___")


def test_fresh_is_refused_for_a_cluster_launch(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    result = subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", "launch-slurm", "MODEL=tiny",
                             "TARGET=cpu", "RUNTIME=venv", "FRESH=1", f"PIPELINE_CHECKPOINTS={tmp_path}"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "error: FRESH=1 with a cluster launch" in result.stderr


def test_hugging_face_variables_pass_through_make_into_the_launch_files(tmp_path):
    """HF_HOME=… on make's command line is the user's setting for huggingface_hub, not a typo: it reaches the
    stage and the sbatch; HF_TOKEN is a secret and is never written there (the job inherits it)."""
    out = tmp_path / "o"
    env_token = {"HF_TOKEN": "hf_secret_value_for_test"}
    os.environ.update(env_token)
    try:
        make("launch-slurm", "MODEL=tiny", "TARGET=cpu", "RUNTIME=venv", f"LAUNCH_DIR={out}", "HF_HOME=/fsx/hf",
             "HF_HUB_OFFLINE=1", "HF_ENDPOINT=https://hf-mirror.example", root=tmp_path / "ckpt")
    finally:
        os.environ.pop("HF_TOKEN")
    script = (out / "train.sbatch").read_text()
    for line in ("export HF_HOME=/fsx/hf", "export HF_HUB_OFFLINE=1", "export HF_ENDPOINT=https://hf-mirror.example"):
        assert line in script
    assert "hf_secret_value_for_test" not in script and "hf_secret_value_for_test" not in (out / "run.json").read_text()


@pytest.mark.parametrize("assignment, expected", [("HF_TOKEN=x", "HF_TOKEN on the command line"),
                                                  ("HF_HOM=/x", "unknown variable HF_HOM"),
                                                  ("PARTITON=trn2", "unknown variable PARTITON (did you mean PARTITION?)")])
def test_a_secret_or_a_typo_on_the_command_line_is_refused(assignment, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    result = subprocess.run(["make", "-n", "--no-print-directory", "launch-slurm", assignment], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and expected in result.stderr and "-m pipeline" not in result.stdout
