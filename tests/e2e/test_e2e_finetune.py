"""`make sft`: the documented one-command chat fine-tuning of the embedded tiny — trains on the chat
set `make data` writes, with held-out eval loss falling, exports and verifies the run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import REPO, copy_model, pipeline_env

def make_in_own_root(target: str, checkpoints: Path, tmp_path: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """`make <target> MODEL=tiny DTYPE=float32` as a user runs it, in a checkpoints root of its own (tiny
    linked in); DTYPE=float32 reaches both the run's HF save and the export, so exports compare exactly."""
    root = copy_model(checkpoints, tmp_path / "root", link=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "IN_CONTAINER")}
    env = pipeline_env(root, env)
    result = subprocess.run(["make", "--no-print-directory", target, "MODEL=tiny", "DTYPE=float32"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, result


pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")]


def test_make_sft_trains_exports_and_verifies_with_eval_loss_falling(checkpoints, tmp_path):
    root, result = make_in_own_root("sft", checkpoints, tmp_path)
    run = root / "tiny" / "runs" / "sft"
    spec = json.loads((run / "run.json").read_text())
    assert spec["data_format"] == "chat" and spec["eval_file"].endswith("chat_eval.jsonl")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, spec["settings"]["steps"] + 1))  # one line per step
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert [r["step"] for r in records if "eval_loss" in r] == [1, 5, 10, 15, 20]
    assert evals[-1] < evals[0] - 0.1, evals  # the held-out conversations get likelier
    assert json.loads((run / "verify.json").read_text())["passed"]  # incl. the step-1 loss = transformers' full logits
    assert (run / "export" / "config.json").exists()
    assert "PASSED" in result.stdout
    # the LM head ran on the first batch's labelled positions only (titan.labelled_loss), not on the prompts
    from safetensors.torch import load_file

    labels = load_file(str(run / "first_batch" / "rank0.safetensors"))["labels"]
    labelled = int((labels != -100).sum())
    assert records[0]["lm_head_positions"] == labelled < labels.numel(), (records[0], labels.shape)


def test_wandb_offline_logs_the_run_under_its_name(checkpoints, tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed in this environment")
    from helpers import cli
    from tiny_checkpoint import ok

    root = copy_model(checkpoints, tmp_path / "root", link=True)
    config = tmp_path / "wandb.toml"
    config.write_text('[train]\nwandb = true\nwandb_project = "ft-test"\n')
    ok(cli("train", "--model", "tiny", "--path", "native", "--steps", "2", "--nproc-per-node", "1",
                    "--config", str(config), "--name", "logged", root=root,
                    env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"}))
    run = root / "tiny" / "runs" / "logged"
    offline = sorted(run.rglob("offline-run-*"))
    assert offline, sorted(str(p.relative_to(run)) for p in run.rglob("*"))[:40]
    history = b"".join(p.read_bytes() for p in offline[0].glob("*.wandb"))
    assert b"tiny/logged" in history and b"ft-test" in history  # run name and project recorded
    assert b"loss_metrics/global_avg_loss" in history  # the steps' metrics were logged


def test_make_lora_trains_adapters_only_and_exports_merged_weights(checkpoints, tmp_path):
    """`make lora`: eval loss falls; the export is a plain checkpoint whose frozen tensors (embeddings,
    norms, lm_head) are the source's bit for bit and whose adapted projections moved; verify passes."""
    from helpers import tensors

    root, _result = make_in_own_root("lora", checkpoints, tmp_path)
    run = root / "tiny" / "runs" / "lora"
    assert json.loads((run / "run.json").read_text())["settings"]["lora_rank"] == 8
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 5 and evals[-1] < evals[0] - 0.05, evals
    assert json.loads((run / "verify.json").read_text())["passed"]
    exported, source = tensors(run / "export"), tensors(root / "tiny" / "source")
    assert set(exported) == set(source)  # no adapter keys: the merged, plain layout
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for key, value in source.items():
        moved = not exported[key].equal(value)
        assert moved == any(p in key for p in projections), key
    # The adapters alone (make lora writes them too): PEFT itself loads them over the source model, and
    # its merge is the export's merged weights — the q/k/v split of the fused wqkv adapter included.
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir = run / "export-adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 8 and set(config["target_modules"]) == set(projections)
    base = AutoModelForCausalLM.from_pretrained(str(root / "tiny" / "source"), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir))
    assert sum(1 for name, _ in peft_model.named_modules() if name.endswith(".lora_A")) == 7 * 2  # 2 layers
    merged = peft_model.merge_and_unload().state_dict()
    for key, value in exported.items():
        assert torch.allclose(merged[key], value, atol=1e-6, rtol=0), (key, (merged[key] - value).abs().max())
