"""pipeline.training.rehearsal: the rehearsed settings come from configs/trn2.toml at run time (every
key but the workload), each difference is named once with its reason, and the plan checks fail on
records of a plan that did not run as planned."""

from __future__ import annotations

import copy
import shutil
from dataclasses import fields, replace

import pytest

from helpers import REPO
from pipeline.checkpoint.arch import arch_from_config
from pipeline.checkpoint.embedded import EMBEDDED
from pipeline.errors import PipelineError
from pipeline.models import registry
from pipeline.run import settings as settings_mod
from pipeline.run.settings import TrainSettings
from pipeline.training import rehearsal

TINY = arch_from_config(EMBEDDED["tiny"].config, "tiny")


@pytest.mark.parametrize("path", registry.names())
@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_every_setting_is_trn2s_or_a_named_difference(model, path):
    arch = arch_from_config(EMBEDDED[model].config, model)
    planned = settings_mod.load("trn2", path, registry.names())
    host = settings_mod.load("cpu", path, registry.names())
    result = rehearsal.plan(path, arch)
    named = {d.key: d for d in result.differences}
    for f in fields(TrainSettings):
        ours, theirs = getattr(result.settings, f.name), getattr(planned, f.name)
        if ours != theirs:
            assert f.name in named, f"{f.name}: {theirs!r} → {ours!r} without a stated reason"
            assert named[f.name].planned == theirs and named[f.name].rehearsed == ours and named[f.name].reason
    assert len(named) == len(result.differences), "a key is explained twice"
    for key in rehearsal.WORKLOAD:
        expected = rehearsal.STEPS if key == "steps" else getattr(host, key)
        assert getattr(result.settings, key) == expected
    # The parallel plan itself is trn2's.
    for key in ("sequence_parallel", "activation_checkpoint", "dtype", "data_parallel_shard", "compile"):
        assert getattr(result.settings, key) == getattr(planned, key), key
    assert result.settings.tensor_parallel >= 2
    assert result.settings.world_size == result.settings.tensor_parallel * rehearsal.data_parallel_degree(host)
    assert "target" in named


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """A copy of configs/ that a test may edit; settings are read from it."""
    target = tmp_path / "configs"
    shutil.copytree(REPO / "configs", target)
    monkeypatch.setattr(settings_mod, "CONFIG_DIR", target)
    return target


def test_trn2_toml_is_read_at_run_time(config_dir):
    toml = config_dir / "trn2.toml"
    text = toml.read_text()
    for old, new in (("activation_checkpoint = \"selective\"", "activation_checkpoint = \"full\""),
                     ("sequence_parallel = true", "sequence_parallel = false"), ("lr = 1e-5", "lr = 3e-5")):
        assert old in text, old
        text = text.replace(old, new)
    if "[paths.hf]\n" in text:
        text = text.replace("[paths.hf]\n", "[paths.hf]\ndtype = \"float32\"\n")
    else:
        text += "\n[paths.hf]\ndtype = \"float32\"\n"
    toml.write_text(text)
    native, hf = rehearsal.plan("native", TINY), rehearsal.plan("hf", TINY)
    assert native.settings.activation_checkpoint == "full" and not native.settings.sequence_parallel
    assert native.settings.lr == 3e-5 and native.settings.dtype == "bfloat16"
    assert hf.settings.dtype == "float32"  # [paths.hf] applies to the hf rehearsal only


def test_neuron_compile_backend_is_substituted_only_when_compiling(config_dir):
    toml = config_dir / "trn2.toml"
    text = toml.read_text()
    for compile_on in (True, False):
        lines = [line for line in text.splitlines() if not line.startswith(("compile =", "compile_backend ="))]
        toml.write_text("\n".join(lines).replace("[train]", f"[train]\ncompile = {str(compile_on).lower()}\n"
                                                            "compile_backend = \"neuron\"", 1) + "\n")
        result = rehearsal.plan("native", TINY)
        named = {d.key for d in result.differences}
        assert result.settings.compile is compile_on
        assert result.settings.compile_backend == ("aot_eager" if compile_on else "neuron")
        assert ("compile_backend" in named) is compile_on


def test_tensor_parallel_degree_follows_the_heads():
    def arch(heads, kv):
        return replace(TINY, num_attention_heads=heads, num_key_value_heads=kv)

    assert rehearsal.tensor_parallel_degree(4, arch(4, 2)) == 2
    assert rehearsal.tensor_parallel_degree(4, arch(8, 4)) == 4
    assert rehearsal.tensor_parallel_degree(4, arch(12, 6)) == 3
    assert rehearsal.tensor_parallel_degree(1, arch(4, 2)) == 2  # at least 2: there is TP to rehearse
    with pytest.raises(PipelineError, match="cannot be split over 2"):
        rehearsal.tensor_parallel_degree(4, arch(5, 5))


# ---- check_plan on recorded layouts ------------------------------------------------------------

def _records(settings: TrainSettings, landmarks: registry.PlanLandmarks, sequence_parallel: bool) -> list[dict]:
    """What 4 ranks (dp_shard 2 × tp 2) of a correct run record, in plan_probe's format."""
    tp, seq = settings.tensor_parallel, settings.seq_len
    local = seq // tp if sequence_parallel else seq
    records = []
    for rank in range(settings.world_size):
        def param(tp_placement):
            return {"kind": "DTensor", "mesh": ["dp_shard", "tp"], "placements": ["S(0)", tp_placement],
                    "shape": [64, 64], "local_shape": [16, 32], "dtype": "float32"}

        modules = {
            landmarks.embedding: {"class": "Embedding", "input": {"local_shape": [2, seq]},
                                  "output": {"local_shape": [2, local, 64]}, "weight_dtype": "bfloat16"},
            landmarks.head: {"class": "Linear", "input": {"local_shape": [2, seq, 64]},
                             "output": {"local_shape": [2, seq, 75968]}, "weight_dtype": "bfloat16"},
            landmarks.block: {"class": "Block", "input": {"local_shape": [2, local, 64]}, "weight_dtype": None},
            landmarks.norm: {"class": "RMSNorm", "input": {"local_shape": [2, local, 64]}, "weight_dtype": "bfloat16"},
            landmarks.attention_input: {"class": "Linear", "input": {"local_shape": [2, seq, 64]},
                                        "weight_dtype": "bfloat16"},
            landmarks.colwise.removesuffix(".weight"): {"class": "Linear", "input": {"local_shape": [2, seq, 64]},
                                                        "weight_dtype": "bfloat16"},
        }
        tp_comms = {"all_gather": 14, "reduce_scatter": 14} if sequence_parallel else {"all_reduce": 10}
        records.append({
            "mesh": {"rank": rank, "world_size": settings.world_size,
                     "dims": {"dp_shard": {"size": 2, "coordinate": rank // tp}, "tp": {"size": tp, "coordinate": rank % tp}}},
            "layout": {"parameters": {landmarks.colwise: param("S(0)"), landmarks.rowwise: param("S(1)"),
                                      "norm.weight": param("R")},
                       "fsdp": {"<root>": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}},
                       "activation_checkpointed": [f"{landmarks.block[:-2]}.{i}" for i in range(TINY.num_hidden_layers)],
                       "compiled": []},
            "step": {"modules": modules, "collectives": {"tp": tp_comms, "batch+dp+dp_shard+loss": {"all_gather": 5}}},
        })
    return records


@pytest.mark.parametrize("path", ["hf", "native"])
def test_check_plan_passes_a_plan_that_ran_and_fails_each_deviation(path):
    settings = replace(rehearsal.plan(path, TINY).settings, sequence_parallel=True, compile=False,
                       activation_checkpoint="selective", dtype="bfloat16")
    landmarks = registry.get(path).landmarks
    good = _records(settings, landmarks, sequence_parallel=True)
    assert all(c.passed for c in rehearsal.check_plan(settings, TINY, landmarks, good))

    def failed(mutate) -> set[str]:
        records = copy.deepcopy(good)
        mutate(records)
        return {c.name for c in rehearsal.check_plan(settings, TINY, landmarks, records) if not c.passed}

    def full_sequence_in_norm(records):
        for r in records:
            r["step"]["modules"][landmarks.norm]["input"]["local_shape"][1] = settings.seq_len

    def replicated_stream(records):
        for r in records:
            r["step"]["modules"][landmarks.embedding]["output"]["local_shape"][1] = settings.seq_len

    def no_reduce_scatter(records):
        for r in records:
            r["step"]["collectives"]["tp"] = {"all_reduce": 10}

    def replicated_colwise(records):
        records[1]["layout"]["parameters"][landmarks.colwise]["placements"][1] = "R"

    def plain_tensor(records):
        records[2]["layout"]["parameters"]["norm.weight"] = {"kind": "Tensor", "dtype": "float32"}

    def fp32_compute(records):
        for r in records:
            r["layout"]["fsdp"]["<root>"]["param_dtype"] = "float32"

    def fp32_weight_in_forward(records):
        records[3]["step"]["modules"][landmarks.head]["weight_dtype"] = "float32"

    def bf16_reduce(records):
        records[0]["layout"]["fsdp"]["<root>"]["reduce_dtype"] = "bfloat16"

    def no_checkpointing(records):
        for r in records:
            r["layout"]["activation_checkpointed"] = []

    def tp_of_one(records):
        for r in records:
            r["mesh"]["dims"]["tp"]["size"] = 1

    assert failed(full_sequence_in_norm) == {"sequence parallel"}
    assert failed(no_reduce_scatter) == {"sequence parallel"}
    assert failed(replicated_stream) == {"sequence parallel"}
    assert failed(replicated_colwise) == {"fsdp × tp layout"}
    assert failed(plain_tensor) == {"fsdp × tp layout"}
    assert failed(fp32_compute) == {"mixed precision"}
    assert failed(bf16_reduce) == {"mixed precision"}
    assert failed(fp32_weight_in_forward) == {"mixed precision"}
    assert failed(no_checkpointing) == {"activation checkpointing"}
    assert failed(tp_of_one) == {"mesh"}
    assert [c.name for c in rehearsal.check_plan(settings, TINY, landmarks, good[:3])] == ["ranks"]


def test_check_plan_without_sequence_parallelism_expects_all_reduces():
    settings = replace(rehearsal.plan("native", TINY).settings, sequence_parallel=False, compile=False)
    landmarks = registry.get("native").landmarks
    checks = rehearsal.check_plan(settings, TINY, landmarks, _records(settings, landmarks, sequence_parallel=False))
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    sp_records = _records(settings, landmarks, sequence_parallel=True)
    assert not {c.name: c.passed for c in rehearsal.check_plan(settings, TINY, landmarks, sp_records)}[
        "tensor parallel activations"]
