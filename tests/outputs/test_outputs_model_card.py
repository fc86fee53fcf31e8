"""pipeline/outputs/model_card.py: the export's README.md names the base model, data, steps, losses and
method, parses as huggingface_hub's ModelCard, and holds no host path."""

from __future__ import annotations

import json

from pipeline.outputs import model_card
from pipeline.run.rundir import RunDir
from helpers import recorded_run, resolved


def test_the_card_says_what_the_checkpoint_is_without_host_paths(tmp_path):
    from dataclasses import replace

    from huggingface_hub import ModelCard

    spec = resolved(tmp_path)
    spec.settings = replace(spec.settings, lora_rank=8, lora_alpha=16.0, dataset="chat")
    spec.data_file, spec.data_format = str(tmp_path / "tiny" / "data" / "chat.jsonl"), "chat"
    run = recorded_run(tmp_path / "tiny" / "runs" / "my-sft", spec, steps_done=2)
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 1, "loss": 8.5, "eval_loss": 8.9}, {"step": 2, "loss": 8.1, "eval_loss": 8.7})))
    (tmp_path / "tiny" / "source.json").write_text(json.dumps({"kind": "embedded", "model": "tiny"}))
    text = model_card.render(RunDir(run.path), step=2, dtype="float32")
    card = ModelCard(text)
    assert card.data.library_name == "transformers" and "qwen3" in card.data.tags
    for expected in ("# my-sft: tiny", "| base model | tiny (embedded) |", "chat.jsonl (chat, loss on assistant turns)",
                     "| steps | 2 of", "LoRA rank 8, alpha 16.0", "| final training loss | 8.1000 |",
                     "8.9000 (step 1) → 8.7000 (step 2)"):
        assert expected in text, (expected, text)
    assert str(tmp_path) not in text and "/tmp" not in text


def test_verify_s_verdict_goes_into_the_card_and_the_manifest_stays_true(tmp_path):
    from types import SimpleNamespace

    from pipeline.checkpoint import manifest

    spec = resolved(tmp_path)
    run = recorded_run(tmp_path / "tiny" / "runs" / "native", spec, steps_done=2)
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"weights")
    model_card.write(export, RunDir(run.path), 2, "float32")
    manifest.write(export, {"step": 2, "dtype": "float32"})
    assert "not verified yet" in (export / "README.md").read_text()
    check = SimpleNamespace
    passed = SimpleNamespace(checks=[check(name="files", passed=True), check(name="load", passed=True)],
                             step1_loss={"export": 8.123456, "logged": 8.1234})
    model_card.record_verdict(export, RunDir(run.path), passed)
    assert "| verify | passed all 2 checks; step-1 loss 8.1235 (logged in training: 8.1234) |" in \
        (export / "README.md").read_text()
    assert manifest.check(export)["step"] == 2 and manifest.read(export)["verify"]["passed"] is True
    failed = SimpleNamespace(checks=[check(name="files", passed=True), check(name="load", passed=False)],
                             step1_loss={"export": None})
    model_card.record_verdict(export, RunDir(run.path), failed)
    assert "| verify | FAILED 1 of 2 checks (first: load) |" in (export / "README.md").read_text()
    assert set(manifest.check(export)["files"]) == {"model.safetensors", "README.md"}
    assert manifest.read(export)["verify"] == {"passed": False, "detail": "FAILED 1 of 2 checks (first: load)"}
