"""pipeline/outputs/export.py export_adapter: a LoRA run's adapters as PEFT writes them, a deliverable of its
own: PEFT's AutoPeftModelForCausalLM loads them over the source from the directory alone and gives the merged
export's logits (native's converter and the hf path's PEFT layers, on one rank and on two FSDP ranks); the
tokenizer and a card beside them; every file 0644 like the export's."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from helpers import run_dir as runs_dir, run_pipeline, source_dir
from stand_in_hub import hub  # noqa: F401 - a fixture

CURRENT_UMASK = os.umask(0o022)
os.umask(CURRENT_UMASK)
IDS = [[9707, 11, 1879, 0, 576, 3974, 13876, 38835]]


@pytest.fixture(scope="module")
def lora_run(tiny_root) -> Path:
    """A 3-step LoRA run of tiny (configs/finetune/lora.toml: rank 8 on every projection), its merged export
    and its adapters, both float32."""
    run_pipeline("train", "--model", "tiny", "--path", "native", "--config", "configs/finetune/lora.toml",
                 "--steps", "3", "--name", "lora", "--export-dtype", "float32", root=tiny_root)
    for extra in ([], ["--adapter"]):
        run_pipeline("export", "--model", "tiny", "--path", "native", "--name", "lora", "--dtype", "float32", *extra,
                     root=tiny_root)
    return runs_dir(tiny_root, "tiny", "lora")


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-fsdp-ranks"])
def hf_lora_run(request, tiny_root) -> Path:
    """A 3-step LoRA run of tiny on the hf path (PEFT's LoRA layers in transformers' Qwen3), its merged export and
    its adapters, both float32."""
    name = f"lora-hf-{request.param}"
    run_pipeline("train", "--model", "tiny", "--path", "hf", "--config", "configs/finetune/lora.toml", "--steps", "3",
                 "--name", name, "--export-dtype", "float32", "--nproc-per-node", str(request.param), root=tiny_root)
    for extra in ([], ["--adapter"]):
        run_pipeline("export", "--model", "tiny", "--path", "hf", "--name", name, "--dtype", "float32", *extra,
                     root=tiny_root)
    return runs_dir(tiny_root, "tiny", name)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.tensor(IDS)).logits


def test_auto_peft_loads_the_adapter_over_the_source_and_equals_the_merged_export(lora_run, tiny_root):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir = lora_run / "export-adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    # a local (embedded) source: its directory, which AutoPeft loads from the adapter directory alone
    assert config["base_model_name_or_path"] == str(source_dir(tiny_root)) and config["peft_type"] == "LORA"
    assert config["r"] == 8 and config["lora_alpha"] == 16.0
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir), dtype=torch.float32)
    assert isinstance(peft_model, PeftModel)
    lora_b = [p for name, p in peft_model.named_parameters() if ".lora_B." in name]
    assert len(lora_b) == 7 * 2 and all(p.abs().max() > 0 for p in lora_b)  # trained: B moved off zero
    merged = AutoModelForCausalLM.from_pretrained(str(lora_run / "export"), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(source_dir(tiny_root)), dtype=torch.float32)
    ours, theirs, plain = logits(peft_model), logits(merged), logits(base)
    assert (theirs - plain).abs().max() > 1e-3  # the adapters change the model
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()


def test_hf_path_lora_adapter_loads_in_peft_and_equals_the_merged_export(hf_lora_run, tiny_root):
    """The hf path trains PEFT's own layers: AutoPeftModelForCausalLM over the source gives the merged export's
    logits; only the adapted projections moved (the frozen tensors are the source's bit for bit)."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    from helpers import tensors

    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    run = json.loads((hf_lora_run / "run.json").read_text())
    assert run["path"] == "hf" and run["settings"]["lora_rank"] == 8
    adapter_dir = hf_lora_run / "export-adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16.0 and set(config["target_modules"]) == projections
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir), dtype=torch.float32)
    lora_b = [p for name, p in peft_model.named_parameters() if ".lora_B." in name]
    assert len(lora_b) == 7 * 2 and all(p.abs().max() > 0 for p in lora_b)  # trained: B moved off zero
    merged = AutoModelForCausalLM.from_pretrained(str(hf_lora_run / "export"), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(source_dir(tiny_root)), dtype=torch.float32)
    ours, theirs, plain = logits(peft_model), logits(merged), logits(base)
    assert (theirs - plain).abs().max() > 1e-3  # training changed the model
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
    exported, source = tensors(hf_lora_run / "export"), tensors(source_dir(tiny_root))
    assert set(exported) == set(source)  # no adapter or base_layer keys: the plain layout
    for key, value in source.items():
        assert (not exported[key].equal(value)) == any(f".{p}." in key for p in projections), key


def test_the_adapter_directory_is_a_repository_with_tokenizer_card_and_ordinary_modes(lora_run):
    from huggingface_hub import ModelCard
    from safetensors import safe_open

    from pipeline.checkpoint import hf_dir, manifest

    adapter_dir = lora_run / "export-adapter"
    names = {p.name for p in adapter_dir.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", manifest.MANIFEST,
            *hf_dir.TOKENIZER_REQUIRED} <= names
    for file in adapter_dir.iterdir():  # safetensors' save_file (PEFT's writer) makes 0600 files
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~CURRENT_UMASK, file.name
    assert stat.S_IMODE((lora_run / "checkpoint" / "step-3" / "lora_adapters.safetensors").stat().st_mode) \
        == 0o666 & ~CURRENT_UMASK
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    card = ModelCard.load(adapter_dir / "README.md")
    assert card.data.library_name == "peft" and "lora" in card.data.tags
    assert "AutoPeftModelForCausalLM" in card.text and "not a Hub repository" in card.text
    assert set(manifest.check(adapter_dir)["files"]) == names - {manifest.MANIFEST}


def test_a_hub_source_s_adapter_names_its_hub_id_and_commit(lora_run, tiny_root, tmp_path):
    """base_model_name_or_path is the Hub id (and revision the commit) when the source came from the Hub."""
    from huggingface_hub import ModelCard

    from pipeline.outputs import export as export_stage
    from pipeline.run.rundir import RunDir

    record = tiny_root / "tiny" / "source.json"
    original = record.read_text()
    try:
        record.unlink()  # perhaps linked to the shared, read-only models: a file of this root's own instead
        record.write_text(json.dumps({"kind": "hub", "model": "Qwen/Qwen3-0.6B", "repo_id": "Qwen/Qwen3-0.6B",
                                      "revision": "main", "commit": "c1" * 20}))
        out = export_stage.export_adapter(export_stage.ExportConfig(RunDir(lora_run), dtype="float32",
                                                                    output=tmp_path / "adapter"))
    finally:
        record.unlink()
        record.write_text(original)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "Qwen/Qwen3-0.6B" and config["revision"] == "c1" * 20
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "Qwen/Qwen3-0.6B" and "not a Hub repository" not in card.text


def test_publish_adapter_uploads_the_adapters_of_the_verified_export(lora_run, tiny_root, hub):
    """`make publish ADAPTER=1`: refused until the merged export of that step is verified, then exactly the
    adapter directory's files (as its manifest lists them) are uploaded."""
    import subprocess

    from helpers import REPO, pipeline_env
    from pipeline.checkpoint import manifest
    from stand_in_hub import publish

    endpoint, received = hub
    refused = publish(tiny_root, endpoint, "--name", "lora", "--adapter", check=False)
    assert refused.returncode == 2 and "never verified" in refused.stderr and not received["files"], refused.stderr
    run_pipeline("verify", "--model", "tiny", "--path", "native", "--name", "lora", root=tiny_root)
    env = {k: v for k, v in pipeline_env(tiny_root).items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    dry = subprocess.run(["make", "--no-print-directory", "publish", "ADAPTER=1", "DRY_RUN=1", "HUB_REPO=team/tiny-lora",
                          "MODEL=tiny", "TRAIN_PATH=native", "RUN_NAME=lora"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]
    assert "export-adapter" in dry.stdout and "  adapter_model.safetensors" in dry.stdout
    assert "  model-00001-of-00002.safetensors" not in dry.stdout
    done = publish(tiny_root, endpoint, "--name", "lora", "--adapter")
    adapter_dir = lora_run / "export-adapter"
    assert set(received["files"]) == {*manifest.check(adapter_dir)["files"], manifest.MANIFEST}
    for name, data in received["files"].items():
        assert data == (adapter_dir / name).read_bytes(), name
    assert "LoRA adapters of step 3" in received["message"] and "published team/tiny-sft" in done.stdout
