"""pipeline/stages/train.py: the native path for real (2 gloo ranks under torchrun, checked against
plain transformers), the trn2 dry run, and launches that are refused."""

import json
import re

import pytest

from pipeline.checkpoint.reference_loss import hf_step1_loss
from pipeline.run.rundir import RunDir
from helpers import read_metrics, run_dir, run_pipeline, source_dir, dry_run_spec


@pytest.fixture(scope="module")
def native_runs(checkpoints):
    out = {}
    for model in ("tiny", "tiny-moe"):
        result = run_pipeline("train", "--model", model, "--path", "native", "--steps", "6", "--fresh", root=checkpoints)
        out[model] = (run_dir(checkpoints, model, "native"), result.stdout)
    return out


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_step1_loss_equals_transformers(native_runs, checkpoints, model):
    native, stdout = native_runs[model]
    metrics = read_metrics(native)
    logged = metrics[0]["loss"]
    assert re.search(rf"^\[rank0\]:step 1/\d+  loss {logged:.6f}  ", stdout, re.M)  # the step line
    reference = hf_step1_loss(source_dir(checkpoints, model), RunDir(native).first_batches())
    assert abs(logged - reference) < 1e-4, (logged, reference)
    assert logged < 9.0  # the pretrained weights loaded: far below ln(151936) = 11.93


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_metrics_and_outputs(native_runs, model):
    native, _ = native_runs[model]
    metrics = read_metrics(native)
    assert [m["step"] for m in metrics] == list(range(1, 7))
    for record in metrics:
        for key in ("loss", "grad_norm", "tokens_per_s", "mfu", "memory_gib"):
            assert record[key] > 0, (key, record)
        assert record["memory_kind"] == "peak RSS (CPU)"
    assert metrics[-1]["loss"] < metrics[0]["loss"]  # it learns
    assert sorted(p.name for p in (native / "first_batch").iterdir()) == ["rank0.safetensors", "rank1.safetensors"]
    assert (native / "checkpoint" / "step-6").is_dir()
    assert json.loads((native / "run.json").read_text())["settings"]["nproc_per_node"] == 2


def test_missing_download_is_a_clear_error(tmp_path):
    result = run_pipeline("train", "--model", "tiny", "--path", "native", root=tmp_path, check=False)
    assert result.returncode == 2 and "has not been downloaded" in result.stderr


def test_trn2_dry_run_prints_the_64_rank_command(tmp_path):
    result = run_pipeline("train", "--model", "Qwen/Qwen3-4B-Instruct-2507", "--path", "native", "--target", "trn2",
                          "--dry-run", root=tmp_path)
    assert "--nproc-per-node=64" in result.stdout and "NEURON_LOGICAL_NC_CONFIG=2" in result.stdout
    spec = dry_run_spec(result.stdout)
    settings = spec["settings"]
    assert settings["tensor_parallel"] == 4 and settings["data_parallel_shard"] == -1 and settings["sequence_parallel"]
    assert spec["arch"]["rope_theta"] == 5e6 and spec["arch"]["head_dim"] == 128
    assert spec["peak_flops_per_rank"] == pytest.approx(667e12 / 4)
    assert spec["run_dir"] == str(tmp_path / "Qwen--Qwen3-4B-Instruct-2507" / "runs" / "native")
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_trn2_launch_without_neuron_devices_is_refused(checkpoints):
    result = run_pipeline("train", "--model", "tiny", "--path", "native", "--target", "trn2", root=checkpoints, check=False)
    assert result.returncode == 2 and "no /dev/neuron* devices" in result.stderr and "Traceback" not in result.stderr


def test_negative_steps_are_refused(checkpoints):
    result = run_pipeline("train", "--model", "tiny", "--path", "native", "--steps", "-1", root=checkpoints, check=False)
    assert result.returncode == 2 and "STEPS=-1 is negative" in result.stderr
