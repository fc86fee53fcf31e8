"""pipeline/models/hf/, the hf training path for real: transformers' Qwen3 under torchtitan,
2 gloo ranks, against native and transformers."""

import json
import re

import pytest
import torch

from pipeline.checkpoint.reference_loss import hf_step1_loss
from pipeline.run.rundir import RunDir
from helpers import read_metrics, run_dir, run_pipeline, source_dir, dry_run_spec

STEPS = 3
MODELS = ["tiny", "tiny-moe"]


@pytest.fixture(scope="module")
def runs(checkpoints):
    out = {}
    for model in MODELS:
        for path in ("hf", "native"):
            result = run_pipeline("train", "--model", model, "--path", path, "--steps", str(STEPS), "--fresh",
                                  root=checkpoints)
            out[model, path] = (run_dir(checkpoints, model, path), result.stdout)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_step1_agrees_with_native_and_transformers(runs, checkpoints, model):
    hf_run, stdout = runs[model, "hf"]
    native_dir, _ = runs[model, "native"]
    hf, native = read_metrics(hf_run)[0], read_metrics(native_dir)[0]
    assert re.search(rf"^\[rank0\]:step 1/\d+  loss {hf['loss']:.6f}  ", stdout, re.M)  # the step line
    assert abs(hf["loss"] - native["loss"]) < 1e-4, (hf["loss"], native["loss"])
    assert abs(hf["grad_norm"] - native["grad_norm"]) < 1e-3 * native["grad_norm"], (hf["grad_norm"], native["grad_norm"])
    reference = hf_step1_loss(source_dir(checkpoints, model), RunDir(hf_run).first_batches())
    assert abs(hf["loss"] - reference) < 1e-4, (hf["loss"], reference)
    assert hf["loss"] < 9.0  # the checkpoint's weights loaded: far below ln(151936) = 11.93


@pytest.mark.parametrize("model", MODELS)
def test_metrics_checkpoint_and_hf_keys(runs, model):
    from torch.distributed.checkpoint import FileSystemReader

    hf_run, _ = runs[model, "hf"]
    metrics = read_metrics(hf_run)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for record in metrics:
        for key in ("loss", "grad_norm", "tokens_per_s", "mfu", "memory_gib"):
            assert record[key] > 0, (key, record)
    assert sorted(p.name for p in (hf_run / "first_batch").iterdir()) == ["rank0.safetensors", "rank1.safetensors"]
    keys = set(FileSystemReader(str(hf_run / "checkpoint" / f"step-{STEPS}")).read_metadata().state_dict_metadata)
    assert "model.layers.0.self_attn.q_proj.weight" in keys  # HF's own names, no wrapper prefix
    assert not any(k.startswith("model.model.") for k in keys)
    if model == "tiny-moe":
        assert "model.layers.0.mlp.experts.gate_up_proj" in keys
    assert json.loads((hf_run / "run.json").read_text())["path"] == "hf"


def test_hf_run_leaves_the_checkpoint_alone(runs, checkpoints):
    # source/ is the downloaded checkpoint; the hf path's --fresh run (runs/hf) must not touch it.
    assert runs["tiny", "hf"][0] == checkpoints / "tiny" / "runs" / "hf"
    assert (source_dir(checkpoints, "tiny") / "config.json").exists() and (checkpoints / "tiny" / "source.json").exists()
    assert not (source_dir(checkpoints, "tiny") / "metrics.jsonl").exists()


def test_trn2_dry_run_has_the_tp_plan_with_sequence_parallel_eager(tmp_path):
    result = run_pipeline("train", "--model", "Qwen/Qwen3-4B-Instruct-2507", "--path", "hf", "--target", "trn2",
                          "--dry-run", root=tmp_path)
    spec = dry_run_spec(result.stdout)
    settings = spec["settings"]
    assert (settings["nproc_per_node"], settings["tensor_parallel"], settings["sequence_parallel"]) == (64, 4, True)
    assert settings["compile"] is False  # trn2.toml [paths.hf]: compiled, its TP plan trains wrong (make rehearse)
    assert spec["arch"]["head_dim"] == 128 and spec["arch"]["rope_theta"] == 5e6


@pytest.mark.parametrize("model", MODELS)
def test_packed_documents_see_only_themselves(model):
    """Block-causal mask + restarting positions == each document run alone by plain transformers."""
    from transformers import AutoModelForCausalLM

    from pipeline.checkpoint.embedded import EMBEDDED
    from pipeline.models import hf as hf_model
    from pipeline.models.hf.model import hf_config

    torch.manual_seed(0)
    config_json = dict(EMBEDDED[model].config)
    with torch.device("meta"):
        model_ = hf_model.HFQwen3.Config(config_json=config_json).build()
    model_.to_empty(device="cpu")
    with torch.no_grad():
        model_.init_states()
    reference = AutoModelForCausalLM.from_config(hf_config(config_json), dtype=torch.float32)
    # RoPE was recomputed after meta init, not left as uninitialised memory.
    assert torch.equal(model_.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    model_.load_state_dict(reference.state_dict(), strict=True)  # same keys as transformers'
    ids = torch.randint(0, 1000, (2, 24))
    positions = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]), torch.cat([torch.arange(5), torch.arange(19)])])
    with torch.no_grad():
        packed = model_(ids, positions=positions)
        for row, cut in ((0, 10), (1, 5)):
            for start, end in ((0, cut), (cut, 24)):
                alone = reference(input_ids=ids[row:row + 1, start:end]).logits[0]
                torch.testing.assert_close(packed[row, start:end], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_adapter_round_trip_uses_on_disk_keys(model):

    from pipeline.checkpoint.embedded import EMBEDDED
    from pipeline.models import hf as hf_model

    config_json = dict(EMBEDDED[model].config)
    model_ = hf_model.HFQwen3.Config(config_json=config_json).build()
    adapter = hf_model.HFQwen3StateDictAdapter(model_.config, None)
    state = model_.state_dict()
    on_disk = adapter.to_hf(state)
    assert set(on_disk) == set(hf_model_arch_keys(config_json))
    back = adapter.from_hf(on_disk)
    assert set(back) == set(state) and all(torch.equal(back[k], v) for k, v in state.items())


def hf_model_arch_keys(config_json: dict) -> set[str]:
    from pipeline.checkpoint.arch import arch_from_config

    return set(arch_from_config(config_json).expected_shapes())
