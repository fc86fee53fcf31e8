"""stages/train.py dry runs on trn2: every real Hub config the pipeline knows × every training path
prints the 64-rank command with its memory estimate, or refuses in one line with a reason that holds
(issue 12, "Dry-run matrix and memory")."""

from __future__ import annotations

import re
import tomllib

import pytest

from helpers import REPO
from pipeline.__main__ import main

# Full tier: each test here runs the CLI in a fresh interpreter (seconds apiece).
pytestmark = pytest.mark.slow

MODELS = tomllib.loads((REPO / "configs" / "models.toml").read_text())
PATHS = ("hf", "native", "nki")
# (model, path) -> None: the 64-rank command; or a regex the one-line refusal must match, and why it holds.
EXPECTED = {
    ("Qwen/Qwen3-0.6B", "hf"): None,
    ("Qwen/Qwen3-0.6B", "native"): None,
    ("Qwen/Qwen3-0.6B", "nki"): None,
    ("Qwen/Qwen3-4B-Instruct-2507", "hf"): None,
    ("Qwen/Qwen3-4B-Instruct-2507", "native"): None,
    ("Qwen/Qwen3-4B-Instruct-2507", "nki"): None,
    # The hf path's TP plan leaves the 128 experts whole on each TP rank: ~27 GiB of parameters,
    # gradients and AdamW state per rank under TP 4 × FSDP 16, over a logical core's 24 GiB; the
    # pipeline's smallest one-node plan (TP 1 × FSDP 64, full checkpointing) needs ~22.5 GiB, over the
    # 21.6 usable. Refused, naming the native path and the two-node plan that fits (test below).
    ("Qwen/Qwen3-30B-A3B", "hf"): r"the hf path needs ~40\.6 GiB per rank, more than the 21\.6 GiB usable .*"
                                  r"no smaller TP degree or activation checkpointing mode fits on 1 node.*"
                                  r"train it on the native path.*NNODES=2 \(the pipeline then chooses TP 4 × FSDP 32",
    ("Qwen/Qwen3-30B-A3B", "native"): None,
    # Qwen3-30B-A3B's expert size 768 (192 per TP rank) is outside moe_cte's 2048..16384 (nki-library).
    ("Qwen/Qwen3-30B-A3B", "nki"): r"moe_cte: intermediate_per_tp_rank=192 must be in 2048\.\.16384",
}


def test_the_matrix_covers_every_known_hub_model_with_a_config():
    assert {m for m, _ in EXPECTED} == set(MODELS)
    for model in MODELS:
        assert (REPO / "configs" / "hub_configs" / f"{model.split('/')[1]}.json").exists()


@pytest.mark.parametrize("model,path", [
    (m, p)
    for m in MODELS for p in PATHS])
def test_trn2_dry_run(model, path, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(tmp_path))
    code = main(["train", "--model", model, "--path", path, "--target", "trn2", "--dry-run"])
    out, err = capsys.readouterr()
    expected = EXPECTED[(model, path)]
    if expected is None:
        assert code == 0, err[-2000:]
        (command,) = [line for line in out.splitlines() if "torch.distributed.run" in line]
        assert "--nproc-per-node=64" in command and "NEURON_LOGICAL_NC_CONFIG=2" in command
        (estimate,) = [line for line in out.splitlines() if line.startswith("memory per rank (estimate)")]
        total, capacity = map(float, re.search(r"([\d.]+) GiB of (\d+) GiB", estimate).groups())
        assert capacity == 24 and 0 < total < 0.9 * capacity
    else:
        assert code == 2
        (line,) = err.strip().splitlines()[-1:]
        assert line.startswith("error: ") and " Fix: " in line
        assert re.search(expected, line), line
    assert list(tmp_path.rglob("*")) == []  # a dry run writes nothing


def test_trn2_hf_moe_on_two_nodes_runs_the_plan_the_pipeline_chose(tmp_path, monkeypatch, capsys):
    """Where the configured plan does not fit and another does, the dry run says which it chose and the
    run is resolved with it (issue 17, 3.6): Qwen3-30B-A3B on hf, two trn2.48xlarge."""
    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(tmp_path / "checkpoints"))
    config = tmp_path / "two-nodes.toml"
    config.write_text("[train]\nnnodes = 2\n")
    code = main(["train", "--model", "Qwen/Qwen3-30B-A3B", "--path", "hf", "--target", "trn2", "--dry-run",
                 "--config", str(config)])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    assert re.search(r"note: the configured plan \(TP 4 × FSDP 32; SP; activation checkpointing selective; .*\) needs "
                     r"~\d+\.\d GiB per rank, over the 21\.6 GiB usable on trn2; the pipeline chose TP 4 × FSDP 32; SP; "
                     r"activation checkpointing full", err), err
    (estimate,) = [line for line in out.splitlines() if line.startswith("memory per rank (estimate)")]
    total = float(re.search(r"([\d.]+) GiB of 24 GiB", estimate).group(1))
    assert "activation checkpointing full" in estimate and total < 0.9 * 24
    assert '"activation_checkpoint": "full"' in out and "--nnodes=2" in out
