"""`make rehearse` (python -m pipeline rehearse) for real: configs/trn2.toml's parallel plan on 4 gloo
ranks for hf, native and nki, then export and verify; the plain CPU run it is compared with; and
the node command `make launch-slurm` / `launch-eks` render, run as two nodes on this machine.

The assertions read what the ranks recorded (plan/rank<N>.json) directly, not only the stage's own
verdict: parameters are DTensors on the (dp_shard, tp) mesh with the planned placements, the
residual stream holds sequence shards while attention and the head see the whole sequence, and
the tp group carried all-gathers and reduce-scatters.
"""

from __future__ import annotations

import json
import tomllib

import pytest

from helpers import REPO, run_pipeline
from pipeline.models import registry
from pipeline.launch.image import IMAGE
from pipeline.launch import rehearsal_runs as stage

PATHS = registry.names()
MODELS = ["tiny", "tiny-moe"]
# The launch files do not depend on the model: their two-node run is rehearsed on tiny only.
NODES = {"tiny": 2, "tiny-moe": 0}
TRN2 = tomllib.loads((REPO / "configs" / "trn2.toml").read_text())


@pytest.fixture(scope="module")
def rehearsals(checkpoints):
    out = {}
    for model in MODELS:
        result = run_pipeline("rehearse", "--model", model, "--nodes", str(NODES[model]), root=checkpoints,
                              timeout=3600)
        summary = json.loads((checkpoints / model / "rehearse" / stage.SUMMARY).read_text())
        print(f"rehearse {model}: {summary['seconds']}")
        out[model] = (summary, result.stdout)
    return out


def _records(summary: dict, path: str) -> list[dict]:
    from pathlib import Path

    from pipeline.run.rundir import RunDir

    return RunDir(Path(summary["paths"][path]["run_dir"])).plan_records()


@pytest.mark.parametrize("model", MODELS)
def test_rehearsal_passes_every_check(rehearsals, model):
    summary, stdout = rehearsals[model]
    assert summary["passed"], [c for c in summary["checks"] if not c["passed"]]
    assert "PASSED" in stdout
    names = {(c["where"], c["name"]) for c in summary["checks"]}
    for path in PATHS:
        for name in ("mesh", "fsdp × tp layout", "mixed precision", "activation checkpointing", "compile",
                     "sequence parallel", "same batch as plain run", "step-1 loss vs plain run",
                     "step-1 grad norm vs plain run", "steps", "export + verify-checkpoint"):
            assert (path, name) in names, (path, name)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("model", MODELS)
def test_the_trn2_plan_ran_on_every_rank(rehearsals, model, path):
    summary, _ = rehearsals[model]
    settings = summary["paths"][path]["settings"]
    differences = {d["key"] for d in summary["paths"][path]["differences"]}
    # The plan is trn2.toml's: every plan key not named as a difference has trn2.toml's value.
    planned = {**TRN2["train"], **TRN2.get("paths", {}).get(path, {})}
    for key in ("sequence_parallel", "activation_checkpoint", "dtype", "data_parallel_shard", "tensor_parallel"):
        if key not in differences:
            assert settings[key] == planned[key], key
    assert settings["sequence_parallel"] is True  # every path, hf included, runs sequence parallelism
    tp, seq = settings["tensor_parallel"], settings["seq_len"]
    assert tp >= 2 and settings["nproc_per_node"] == 2 * tp
    landmarks = registry.get(path).landmarks

    records = _records(summary, path)
    assert len(records) == 2 * tp
    assert sorted((r["mesh"]["dims"]["dp_shard"]["coordinate"], r["mesh"]["dims"]["tp"]["coordinate"])
                  for r in records) == [(d, t) for d in range(2) for t in range(tp)]
    for r in records:
        params = r["layout"]["parameters"]
        assert all(p["kind"] == "DTensor" and p["mesh"][0] == "dp_shard" for p in params.values())
        colwise, rowwise = params[landmarks.colwise], params[landmarks.rowwise]
        assert colwise["mesh"] == rowwise["mesh"] == ["dp_shard", "tp"]
        assert colwise["placements"][1] == "S(0)" and rowwise["placements"][1] == "S(1)"
        assert colwise["local_shape"][0] * 2 * tp == colwise["shape"][0]  # split over both dims
        assert {m["param_dtype"] for m in r["layout"]["fsdp"].values()} == {"bfloat16"}
        assert {m["reduce_dtype"] for m in r["layout"]["fsdp"].values()} == {"float32"}
        modules = r["step"]["modules"]
        # Sequence shards between blocks, the full sequence in attention and in the head.
        assert modules[landmarks.embedding]["output"]["local_shape"][1] == seq // tp
        assert modules[landmarks.head]["input"]["local_shape"][1] == seq
        if not r["layout"]["compiled"]:
            assert modules[landmarks.block]["input"]["local_shape"][1] == seq // tp
            assert modules[landmarks.norm]["input"]["local_shape"][1] == seq // tp
            assert modules[landmarks.attention_input]["input"]["local_shape"][1] == seq
            on_tp = r["step"]["collectives"]["tp"]
            assert on_tp["all_gather"] > 0 and on_tp["reduce_scatter"] > 0, on_tp
        # Vocab-parallel logits: each tp rank holds its share of the vocabulary.
        assert modules[landmarks.head]["output"]["local_shape"][-1] * tp == 151936
        assert len(r["layout"]["activation_checkpointed"]) == 2  # both blocks


@pytest.mark.parametrize("model", MODELS)
def test_each_path_runs_its_own_modules(rehearsals, model):
    summary, _ = rehearsals[model]
    classes = {path: set(summary["paths"][path]["ran"]["module_classes"]) for path in PATHS}
    hf_attention = "Qwen3MoeAttention" if model == "tiny-moe" else "Qwen3Attention"
    assert hf_attention in classes["hf"] and "GQAttention" not in classes["hf"]
    assert "GQAttention" in classes["native"] and "NkiRoPE" not in classes["native"]
    assert "NkiRoPE" in classes["nki"] and "CosSinRoPE" not in classes["nki"]
    if model == "tiny-moe":
        assert {"NkiRouter", "NkiExperts"} <= classes["nki"]
        assert "LoopExperts" in classes["native"]
        assert {"Qwen3MoeTopKRouterPipeline", "Qwen3MoeExpertsPipeline"} <= classes["hf"]


@pytest.mark.parametrize("model", MODELS)
def test_step1_agrees_with_the_plain_cpu_run(rehearsals, model):
    summary, _ = rehearsals[model]
    plain = summary["plain"]
    assert plain["settings"]["dtype"] == "float32" and plain["settings"]["tensor_parallel"] == 1
    for path in PATHS:
        step1 = summary["paths"][path]["step1"]
        assert abs(step1["loss"] - plain["loss"]) <= stage.LOSS_TOLERANCE, (path, step1, plain)
        kind = "moe" if model == "tiny-moe" else "dense"
        assert abs(step1["grad_norm"] - plain["grad_norm"]) <= stage.GRAD_NORM_TOLERANCE[kind] * plain["grad_norm"]
        assert summary["paths"][path]["verify"]["passed"]


def test_two_nodes_run_the_rendered_commands(rehearsals):
    summary, _ = rehearsals["tiny"]
    assert set(summary["nodes"]) == {"slurm", "eks"}
    for scheduler, node in summary["nodes"].items():
        assert node["exit_codes"] == [0, 0]
        assert abs(node["step1"]["loss"] - summary["plain"]["loss"]) <= stage.NODES_LOSS_TOLERANCE
        command = node["commands"][0]
        assert "--nnodes=2 --rdzv-backend=c10d" in command and '"--rdzv-endpoint=${MASTER_ADDR}:${MASTER_PORT:-29500}"' in command
        rendered = open(node["files"]["train.sbatch" if scheduler == "slurm" else "job.yaml"]).read()
        if scheduler == "slurm":
            assert f"NODE_CMD=\"$(cat <<'NODE'\n{command}\nNODE\n)\"" in rendered
        else:  # the pod's command, with the image's python and the ConfigMap's mount mapped to this machine
            import sys

            import yaml

            from pipeline.launch import cluster as launch

            (container,) = [d for d in yaml.safe_load_all(rendered) if d["kind"] == "Job"][0]["spec"]["template"][
                "spec"]["containers"]
            pod = container["command"][-1]
            assert IMAGE.python in pod and launch.RUN_JSON_IN_POD in pod
            run_json = command.rsplit(" ", 1)[1]
            assert pod.replace(IMAGE.python, sys.executable).replace(launch.RUN_JSON_IN_POD, run_json) == command


def test_make_rehearse_runs_the_stage():
    import subprocess

    result = subprocess.run(["make", "-n", "--no-print-directory", "rehearse", "MODEL=tiny-moe", "NODES=0"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    import shlex

    lines = result.stdout.replace("\\\n", " ").splitlines()  # a recipe line continued with a backslash is one command
    commands = [shlex.split(line) for line in lines if "-m pipeline" in line]  # the words the shell runs
    assert [".venv/bin/python", "-m", "pipeline", "rehearse", "--model", "tiny-moe", "--nodes", "0"] in commands
