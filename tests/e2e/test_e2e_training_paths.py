"""Every training path end to end, 2 steps: train → export → verify, on whichever torchtitan API is
installed (pipeline.titan.api). The full tier covers these flows on torchtitan 0.3.0 in depth (export,
verify, rehearse tests); this module is what the upstream-main tier (`make test-titan-main`) adds to the
fast tests there, and `make test` leaves it out."""

from __future__ import annotations

import json

import pytest

from helpers import copy_model, run_dir, run_pipeline
from pipeline.titan import api

pytestmark = [pytest.mark.slow, pytest.mark.titan_e2e]

CASES = [("tiny", "hf"), ("tiny", "native"), ("tiny", "nki"), ("tiny-moe", "nki")]


@pytest.fixture(scope="module")
def root(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    for model in {model for model, _ in CASES}:
        copy_model(checkpoints, root, model, link=True)
    return root


@pytest.mark.parametrize("model,path", CASES)
def test_trains_exports_and_verifies(root, model, path):
    trained = run_pipeline("train", "--model", model, "--path", path, "--steps", "2", "--export-dtype", "float32", root=root)
    # the ranks really ran on the installed API, not on a fallback
    assert f"torchtitan API: {api.variant()}" in trained.stdout + trained.stderr
    run_pipeline("export", "--model", model, "--path", path, "--dtype", "float32", root=root)
    verified = run_pipeline("verify", "--model", model, "--path", path, root=root)
    assert "PASSED" in verified.stdout
    report = json.loads((run_dir(root, model, path) / "verify.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    # the logged step-1 loss is plain transformers' on the recorded batch: the weights loaded, the batch
    # reached the model as recorded (packed tokens on main), and the loss is torchtitan's
    assert report["passed"] and checks["step1-loss-source"]["passed"], checks["step1-loss-source"]
    assert checks["load"]["passed"]


def test_chat_sft_masks_the_prompts_on_the_installed_api(root):
    """Multi-turn chat SFT (make sft's settings) on the installed API: the logged step-1 loss is plain
    transformers' over the recorded batch, whose labels keep only the assistant turns (so the mask and
    each conversation's own positions reached the model as recorded), and eval loss is logged."""
    from pipeline.data import chat

    run_pipeline("train", "--model", "tiny", "--path", "native", "--steps", "3", "--dataset", "chat",
                 "--config", "configs/finetune/sft.toml", "--name", "sft-e2e", "--export-dtype", "float32", root=root)
    run_pipeline("export", "--model", "tiny", "--path", "native", "--name", "sft-e2e", "--dtype", "float32", root=root)
    verified = run_pipeline("verify", "--model", "tiny", "--path", "native", "--name", "sft-e2e", root=root)
    assert "PASSED" in verified.stdout
    run = run_dir(root, "tiny", "sft-e2e")
    checks = {c["name"]: c for c in json.loads((run / "verify.json").read_text())["checks"]}
    assert checks["step1-loss-source"]["passed"], checks["step1-loss-source"]
    from safetensors.torch import load_file

    batch = load_file(str(run / "first_batch" / "rank0.safetensors"))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "eval_loss" in m] == [1], metrics
    masked = (batch["labels"] == chat.IGNORE_INDEX).float().mean().item()
    assert 0.2 < masked < 0.95, masked  # prompts and padding masked, assistant turns trained
    # the LM head ran on those labelled positions only (titan.labelled_loss), and the loss is still transformers'
    assert metrics[0]["lm_head_positions"] == int((batch["labels"] != chat.IGNORE_INDEX).sum()), metrics[0]
    starts = int((batch["positions"].flatten() == 0).sum())
    assert starts >= 2, starts  # packed conversations, each with its own positions from 0


def test_dpo_on_the_installed_api(root):
    """DPO (make dpo's config, 2 steps) on the installed API: at step 1 the policy is the reference, so the loss is
    ln 2, and its completion log-probabilities are plain transformers' on the recorded batch, read row by row from
    the positions (main lays a batch's rows end to end, #4121); the policy moves by step 2; export and verify
    pass."""
    import math

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_pipeline("train", "--model", "tiny", "--path", "native", "--steps", "2", "--dataset", "preference",
                 "--config", "configs/finetune/dpo.toml", "--name", "dpo-e2e", "--export-dtype", "float32", root=root)
    run_pipeline("export", "--model", "tiny", "--path", "native", "--name", "dpo-e2e", "--dtype", "float32", root=root)
    assert "PASSED" in run_pipeline("verify", "--model", "tiny", "--path", "native", "--name", "dpo-e2e", root=root).stdout
    run = run_dir(root, "tiny", "dpo-e2e")
    first, second = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][:2]
    assert first["step"] == 1 and abs(first["loss"] - math.log(2)) < 1e-6, first
    assert abs(first["rewards/margins"]) < 1e-6 and abs(second["rewards/margins"]) > 1e-5, (first, second)

    batch = load_file(str(run / "first_batch" / "rank0.safetensors"))
    ids, labels, positions = (batch[key].flatten() for key in ("input", "labels", "positions"))
    starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
    pairs = json.loads((run / "run.json").read_text())["settings"]["local_batch_size"]
    assert len(starts) - 1 == 2 * pairs  # a chosen and a rejected row per pair
    model = AutoModelForCausalLM.from_pretrained(str(root / "tiny" / "source"), dtype=torch.float32).eval()
    logps = []
    for begin, end in zip(starts, starts[1:]):
        row, row_labels = ids[begin:end], labels[begin:end]
        with torch.no_grad():
            logits = model(input_ids=row.unsqueeze(0)).logits[0].float()
        mask = row_labels != -100
        assert mask.any() and not mask[0]  # a completion is labelled, the prompt's start never
        token = torch.log_softmax(logits, -1).gather(-1, row_labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        logps.append(float((token * mask).sum()))
    for side, values in (("chosen", logps[:pairs]), ("rejected", logps[pairs:])):  # the chosen rows come first
        expected = sum(values) / pairs
        assert abs(first[f"logps/{side}"] - expected) < 1e-5 * abs(expected), (side, first[f"logps/{side}"], expected)
