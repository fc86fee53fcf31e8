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
