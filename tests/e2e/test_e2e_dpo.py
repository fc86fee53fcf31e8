"""`make dpo` on the embedded tiny: DPO on two preference pairs, checked against plain transformers on the recorded
batch (step 1: the policy is the reference, every pair's loss ln 2, the completion log-probabilities transformers'),
the recorded masks (no prompt token labelled), the frozen reference (step 2's reference log-probabilities are step
1's), and TRL 1.16's DPOTrainer after one optimizer step from the same weights, pairs, lr and β. The LoRA variant
runs on two FSDP ranks; full DPO on two FSDP ranks and on two TP ranks equals one rank. Two pairs make every batch the
whole set, so data order is the same in both trainers."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import REPO, cli, copy_model, pipeline_env

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")]

BETA, LR, SEQ_LEN = 0.1, 1e-3, 128
# TRL vs this pipeline after one optimizer step, both float32 on CPU (TRL's bf16 default off). Measured |diff|:
# loss 1.2e-6, rewards/margins < 1e-7, rewards/chosen and rewards/rejected 6.6e-5 each (the same shift, so the
# margin keeps it out: AdamW's first step is lr·g/(|g| + eps), and gradient elements near eps differ in their last
# bits between the two implementations' sums), logps/chosen 2e-6 relative. The bounds, absolute:
TRL_TOLERANCE = {"loss": 2e-5, "rewards/margins": 2e-5, "rewards/chosen": 3e-4, "rewards/rejected": 3e-4,
                 "rewards/accuracies": 0.0, "logps/chosen": 3e-3, "logps/rejected": 3e-3}


def _pairs(checkpoints: Path, tmp_path: Path) -> tuple[Path, Path, list[dict]]:
    """The embedded set's first two pairs to train on, its next two held out (`make data` wrote them)."""
    lines = (checkpoints / "tiny" / "data" / "preference.jsonl").read_text().splitlines()
    train, held = tmp_path / "pairs.jsonl", tmp_path / "held.jsonl"
    train.write_text("\n".join(lines[:2]) + "\n")
    held.write_text("\n".join(lines[2:4]) + "\n")
    return train, held, [json.loads(line) for line in lines[:2]]


def _config(tmp_path: Path, held: Path, **extra) -> Path:
    config = tmp_path / "dpo.toml"
    body = {"nproc_per_node": 1, "steps": 2, "lr": LR, "warmup_steps": 1, "local_batch_size": 2, "seq_len": SEQ_LEN,
            "eval_every": 1, "eval_steps": 1, "eval_dataset": str(held), "checkpoint_interval": 10, "dpo_beta": BETA,
            **extra}
    config.write_text("[train]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in body.items()))
    return config


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _transformers_logps(source: Path, run: Path) -> list[tuple[float, float]]:
    """(chosen, rejected) completion log-probability of every recorded pair, by plain transformers."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    out = []
    for file in sorted((run / "first_batch").glob("rank*.safetensors")):
        batch = load_file(str(file))
        with torch.no_grad():
            logits = model(input_ids=batch["input"]).logits.float()
        labels = batch["labels"]
        mask = labels != -100
        token = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        sums = (token * mask).sum(dim=1).tolist()
        half = len(sums) // 2
        out += list(zip(sums[:half], sums[half:]))
    return out


def _check_step1_and_frozen_reference(run: Path, source: Path) -> list[dict]:
    records = _records(run)
    first, second = records[0], records[1]
    assert first["step"] == 1 and abs(first["loss"] - math.log(2)) < 1e-6, first  # policy = reference
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(first[key]) < 1e-6, (key, first[key])  # both log-ratios 0
    pairs = _transformers_logps(source, run)
    assert len(pairs) == 2
    loss = sum(-math.log(1 / (1 + math.exp(-BETA * ((c - c) - (r - r))))) for c, r in pairs) / len(pairs)
    assert abs(first["loss"] - loss) < 1e-6
    for side, index in (("chosen", 0), ("rejected", 1)):
        expected = sum(p[index] for p in pairs) / len(pairs)
        assert abs(first[f"logps/{side}"] - expected) < 1e-5 * abs(expected), (side, first[f"logps/{side}"], expected)
        # step 2 sees the same pairs: its reference log-probability (policy − reward/β) is step 1's, frozen
        reference = second[f"logps/{side}"] - second[f"rewards/{side}"] / BETA
        assert abs(reference - first[f"logps/{side}"]) < 1e-5 * abs(expected), (side, reference, first)
    assert abs(second["rewards/margins"]) > 1e-4 and second["loss"] != first["loss"]  # the policy moved
    return records


def test_make_dpo_matches_transformers_and_trl(checkpoints, tmp_path):
    train, held, pairs = _pairs(checkpoints, tmp_path)
    root = copy_model(checkpoints, tmp_path / "root", link=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "IN_CONTAINER")}
    result = subprocess.run(["make", "--no-print-directory", "dpo", "MODEL=tiny", "DTYPE=float32", f"DATASET={train}",
                             f"CONFIG={_config(tmp_path, held)}"], cwd=REPO, env=pipeline_env(root, env),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run, source = root / "tiny" / "runs" / "dpo", root / "tiny" / "source"
    records = _check_step1_and_frozen_reference(run, source)
    assert [r["step"] for r in records if "eval_loss" in r] == [1, 2] and "eval_rewards/accuracies" in records[0]

    # The recorded masks: every labelled token of a row is its completion, the prompt never.
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(source))
    batch = load_file(str(run / "first_batch" / "rank0.safetensors"))
    completions = sorted(f"<think>\n\n</think>\n\n{p[side][0]['content']}<|im_end|>\n" for p in pairs
                         for side in ("chosen", "rejected"))
    decoded, prompts = [], []
    for row in range(4):
        labels, ids = batch["labels"][row], batch["input"][row]
        labelled = (labels != -100).nonzero().flatten()
        decoded.append(tokenizer.decode(labels[labelled]))
        prompts.append(tokenizer.decode(ids[:labelled[0] + 1]))
    assert sorted(decoded) == completions
    rendered = sorted(tokenizer.apply_chat_template(p["prompt"], add_generation_prompt=True, tokenize=False)
                      for p in pairs)
    assert sorted(prompts) == sorted(rendered * 2)  # what precedes the first labelled token is the whole prompt

    card = (run / "export" / "README.md").read_text()
    assert "DPO" in card and f"β {BETA}" in card and json.loads((run / "verify.json").read_text())["passed"]
    spec = json.loads((run / "run.json").read_text())
    assert spec["data_format"] == "preference" and "reference model" in spec["memory"]["parts_gib"]

    # TRL 1.16's DPOTrainer, one optimizer step from the same weights on the same pairs, lr and β: step 2's metrics.
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=2, max_steps=2, learning_rate=LR,
                     lr_scheduler_type="constant", warmup_steps=0, beta=BETA, adam_beta2=0.95, weight_decay=0.0,
                     max_grad_norm=1.0, logging_steps=1, report_to=[], save_strategy="no", max_length=SEQ_LEN,
                     use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs), processing_class=tokenizer)
    trainer.train()
    trl = [h for h in trainer.state.log_history if "rewards/chosen" in h]
    assert abs(trl[0]["loss"] - math.log(2)) < 1e-6
    ours = records[1]
    assert trl[0]["logps/chosen"] == pytest.approx(records[0]["logps/chosen"], rel=1e-6)  # the same forward, step 1
    for key, bound in TRL_TOLERANCE.items():
        assert abs(trl[1][key] - ours[key]) <= bound, (key, trl[1][key], ours[key])
    assert abs(ours["rewards/margins"]) > 100 * TRL_TOLERANCE["rewards/margins"]  # a margin the bound can tell


@pytest.mark.parametrize("path", ["native", "hf"])  # torchtitan's LoRA converter; PEFT's layers (lora_B.default)
def test_lora_dpo_on_two_ranks_keeps_the_base_as_reference(checkpoints, tmp_path, path):
    from tiny_checkpoint import ok

    train, held, _ = _pairs(checkpoints, tmp_path)
    root = copy_model(checkpoints, tmp_path / "root", link=True)
    config = _config(tmp_path, held, nproc_per_node=2, local_batch_size=1, lora_rank=8, lora_alpha=16.0, lr=2e-3)
    ok(cli("train", "--model", "tiny", "--path", path, "--config", str(config), "--dataset", str(train),
           "--name", "lora-dpo", "--export-dtype", "float32", root=root))
    run = root / "tiny" / "runs" / "lora-dpo"
    _check_step1_and_frozen_reference(run, root / "tiny" / "source")
    assert "reference model" not in json.loads((run / "run.json").read_text())["memory"]["parts_gib"]


def test_an_equal_pair_is_refused_before_launch(checkpoints, tmp_path):
    train, held, pairs = _pairs(checkpoints, tmp_path)
    equal = {**pairs[0], "rejected": pairs[0]["chosen"]}
    train.write_text(train.read_text() * 3 + json.dumps(equal) + "\n")  # line 7: past the lines every check reads
    root = copy_model(checkpoints, tmp_path / "root", link=True)
    result = cli("train", "--model", "tiny", "--path", "native", "--config", str(_config(tmp_path, held)),
                 "--dataset", str(train), "--name", "equal", root=root)
    assert result.returncode == 2 and "pairs.jsonl:7 has equal \"chosen\" and \"rejected\"" in result.stderr, result.stderr
    assert not (root / "tiny" / "runs" / "equal").exists()


def test_full_dpo_on_two_fsdp_ranks_and_on_two_tp_ranks_equals_one_rank(checkpoints, tmp_path):
    """The same global batch of two pairs on 1 rank, on 2 FSDP ranks and on 2 TP ranks gives the same step-2 loss and
    rewards. FSDP: the policy's forward runs on the policy's weights after the reference's (FSDP keeps torchtitan's
    norm and lm_head gathered after a forward; without a reshard the policy would reuse the reference's). TP: each
    rank holds half the vocabulary's logits, and torchtitan's loss-parallel cross-entropy makes every token's
    log-probability exact."""
    from tiny_checkpoint import ok

    train, held, _ = _pairs(checkpoints, tmp_path)
    root = copy_model(checkpoints, tmp_path / "root", link=True)
    for name, extra in (("one", {}), ("two", {"nproc_per_node": 2, "local_batch_size": 1}),
                        ("tp", {"nproc_per_node": 2, "tensor_parallel": 2, "data_parallel_shard": 1})):
        (tmp_path / name).mkdir()
        config = _config(tmp_path / name, held, **extra)
        ok(cli("train", "--model", "tiny", "--path", "native", "--config", str(config), "--dataset", str(train),
               "--name", name, root=root))
    one, two, tp = (_records(root / "tiny" / "runs" / name) for name in ("one", "two", "tp"))
    first = lambda records, step: next(r for r in records if r["step"] == step and "loss" in r)  # noqa: E731
    # the bounds of the TRL comparison: the same first AdamW step from sums taken in another order (2 ranks' reduction)
    for other in (two, tp):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert abs(first(one, 2)[key] - first(other, 2)[key]) <= TRL_TOLERANCE[key], (key, first(one, 2), first(other, 2))
        assert first(other, 1)["logps/chosen"] == pytest.approx(first(one, 1)["logps/chosen"], rel=1e-6)
    assert abs(first(two, 2)["rewards/margins"]) > 1e-4  # step 2's policy is not the reference: the check can fail
    # the TP run ran on a tp mesh of 2, its data on one data-parallel rank (torchtitan's own log line)
    logs = (root / "tiny" / "runs" / "tp" / "logs").glob("*/attempt_0/0/stdout.log")
    assert "dp_shard=1, cp=1, tp=2" in "".join(log.read_text() for log in logs)
