"""train --path nki for real on CPU: the overrides attach, their ops run in every step — RoPE once
per layer forward and once backward (the HF loader gives per-token positions with every batch),
router and experts once per MoE layer each way — and the step-1 loss equals native's, which is
only a check of the ops because they ran."""

import json

from helpers import read_metrics, run_pipeline

from pipeline.checkpoint.embedded import EMBEDDED
from pipeline.models.nki.ops import COUNTS_DIR_ENV

STEPS = 2


def test_nki_training_calls_its_ops_every_step_and_matches_native(checkpoints, tmp_path, monkeypatch):
    counts_dir = tmp_path / "op_counts"
    monkeypatch.setenv(COUNTS_DIR_ENV, str(counts_dir))
    for path in ("native", "nki"):
        run_pipeline("train", "--model", "tiny-moe", "--path", path, "--steps", str(STEPS), "--fresh", root=checkpoints)

    layers = EMBEDDED["tiny-moe"].config["num_hidden_layers"]  # every layer is MoE (decoder_sparse_step 1)
    per_step = {"rope_hf.forward": layers, "rope_hf.backward": layers, "router_topk.forward": layers,
                "router_topk.backward": layers, "experts.forward": layers, "experts.backward": layers}
    ranks = sorted(counts_dir.glob("rank*.json"))
    assert [p.name for p in ranks] == ["rank0.json", "rank1.json"]  # the nki run's two ranks; native calls none
    for rank in ranks:
        assert json.loads(rank.read_text()) == {name: n * STEPS for name, n in per_step.items()}, rank.name

    runs = checkpoints / "tiny-moe" / "runs"
    spec = json.loads((runs / "nki" / "run.json").read_text())
    attached = {entry[0].rsplit(".", 1)[-1]: entry[1]["use_nki"] for entry in spec["overrides"]
                if isinstance(entry, list)}
    assert attached == {"nki_rope": False, "nki_router": False, "nki_experts": False}  # CPU: the references
    assert not any("loop_experts" in str(entry) for entry in spec["overrides"])

    native, nki = read_metrics(runs / "native"), read_metrics(runs / "nki")
    assert abs(native[0]["loss"] - nki[0]["loss"]) < 1e-6
    assert abs(native[0]["grad_norm"] - nki[0]["grad_norm"]) < 1e-5 * native[0]["grad_norm"]
