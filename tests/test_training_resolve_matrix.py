"""stages/train.py dry runs on trn2: every real Hub config the pipeline knows × every training path
prints the 64-rank command with its memory estimate, or refuses in one line with a reason that holds
(issue 12, "Dry-run matrix and memory")."""

from __future__ import annotations

import re
import tomllib

import pytest

from conftest import REPO
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
    # The hf path's TP plan leaves the 128 experts whole on each TP rank: ~28 GiB of parameters,
    # gradients and AdamW state per rank under FSDP 16 alone, over a logical core's 24 GiB.
    ("Qwen/Qwen3-30B-A3B", "hf"): r"the hf path needs ~\d+\.\d GiB per rank, more than the 21\.6 GiB usable .*"
                                  r"train it on the native path",
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
