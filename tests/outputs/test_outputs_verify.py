"""pipeline/stages/verify.py (`make verify-checkpoint`): reload, keys, tensors, step-1 losses,
verify.json; bad exports fail."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.__main__ import main
from pipeline.checkpoint import hf_dir, manifest
from pipeline.run.rundir import RunDir
from pipeline.outputs import export as export_stage
from pipeline.outputs.verify import verify
from helpers import (TRAINED_STEPS, fake_run, hf_shard, read_metrics, record_hashes, run_dir as runs_dir, run_pipeline,
                     source_dir, tied_source_with_lm_head)

SCHEMA = {"passed", "checkpoint", "reference", "checks", "missing_keys", "unexpected_keys", "mismatched_keys", "step1_loss",
          "step1_expectation", "reported"}


@pytest.fixture(scope="session")
def runs(export_runs) -> Path:
    return export_runs


@pytest.fixture(scope="session")
def exports(runs, tmp_path_factory) -> dict:
    """(model, step, dtype) → an export of that run's checkpoint, made once."""
    base = tmp_path_factory.mktemp("exports")
    out = {}
    for model, step, dtype in (("tiny", 0, "float32"), ("tiny", 0, "bfloat16"), ("tiny-moe", 0, "float32"),
                               ("tiny", TRAINED_STEPS, "bfloat16"), ("tiny-moe", TRAINED_STEPS, "float32")):
        # Sharded as the sources are (an index and several files), for the index checks below.
        out[model, step, dtype] = export_stage.export(export_stage.ExportConfig(
            RunDir(runs_dir(runs, model, "native")), dtype=dtype, step=step, output=base / f"{model}-{step}-{dtype}"))
    return out


def checks(result) -> dict:
    return {c.name: c for c in result.checks}


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_step0_round_trip_passes_with_the_logged_step1_loss(runs, exports, tmp_path, model):
    run_dir = runs_dir(runs, model, "native")
    result = verify(exports[model, 0, "float32"], source_dir(runs, model), RunDir(run_dir), tmp_path / "verify.json")
    by_name = checks(result)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert {"files", "manifest", "load", "keys", "shapes", "dtypes", "finite", "round-trip",
            "step1-loss-source", "step1-loss-export"} <= set(by_name)
    logged = read_metrics(run_dir)[0]["loss"]
    losses = result.step1_loss
    assert losses["logged"] == logged
    assert abs(losses["export"] - logged) < 1e-5 and abs(losses["reference"] - logged) < 1e-4
    assert losses["export"] < 9.0  # pretrained weights, far below ln(vocab) = 11.93
    written = json.loads((tmp_path / "verify.json").read_text())
    assert set(written) == SCHEMA and written["passed"] is True
    assert written["missing_keys"] == written["unexpected_keys"] == written["mismatched_keys"] == []
    assert all(set(c) == {"name", "passed", "detail"} for c in written["checks"])
    assert "tied" in by_name["keys"].detail if model == "tiny" else "untied" in by_name["keys"].detail


def test_bf16_step0_export_is_bitwise_the_cast_source_and_close_in_loss(runs, exports, tmp_path):
    run_dir = runs_dir(runs, "tiny", "native")
    result = verify(exports["tiny", 0, "bfloat16"], source_dir(runs, "tiny"), RunDir(run_dir), tmp_path / "verify.json")
    assert result.passed, [c for c in result.checks if not c.passed]
    assert "24/24 tensors bitwise equal" in checks(result)["round-trip"].detail
    assert result.step1_loss["export"] != result.step1_loss["logged"]  # bf16 rounding is real…
    assert abs(result.step1_loss["export"] - result.step1_loss["logged"]) < 2e-2  # …and small


@pytest.mark.parametrize("model,dtype", [("tiny", "bfloat16"), ("tiny-moe", "float32")])
def test_trained_export_changed_and_source_matches_step1(runs, exports, tmp_path, model, dtype):
    run_dir = runs_dir(runs, model, "native")
    result = verify(exports[model, TRAINED_STEPS, dtype], source_dir(runs, model), RunDir(run_dir),
                    tmp_path / "verify.json")
    by_name = checks(result)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert "round-trip" not in by_name and "changed" in by_name
    changed, total = (int(x) for x in by_name["changed"].detail.split(": ")[1].split(" ")[0].split("/"))
    assert changed > total // 2
    assert abs(result.step1_loss["reference"] - read_metrics(run_dir)[0]["loss"]) < 1e-4
    assert result.step1_loss["export"] != result.step1_loss["reference"]


def test_steps0_run_uses_a_sibling_runs_first_batch(runs, exports, tmp_path):
    """A STEPS=0 run records no batch: another run of the same model and source lends its own."""
    root = tmp_path / "root"
    (root / "tiny").mkdir(parents=True)
    source = source_dir(root, "tiny")
    source.symlink_to(source_dir(runs, "tiny"))
    trained = runs_dir(runs, "tiny", "native")
    spec = json.loads((trained / "run.json").read_text())
    only0 = runs_dir(root, "tiny", "native")
    only0.mkdir(parents=True)
    (only0 / "run.json").write_text(json.dumps({**spec, "source_dir": str(source), "run_dir": str(only0)}))
    shutil.copytree(trained / "checkpoint" / "step-0", only0 / "checkpoint" / "step-0")  # what it saved, verify compares
    result = verify(exports["tiny", 0, "float32"], source, RunDir(only0), tmp_path / "v0.json")
    assert result.passed and result.step1_loss["logged"] is None
    assert "held-out corpus" in checks(result)["step1-loss-export"].detail
    assert result.step1_loss["export"] == result.step1_loss["reference"]
    sibling = runs_dir(root, "tiny", "other")
    shutil.copytree(trained / "first_batch", sibling / "first_batch")
    shutil.copy(trained / "metrics.jsonl", sibling / "metrics.jsonl")
    (sibling / "run.json").write_text(json.dumps({**spec, "source_dir": str(source), "run_dir": str(sibling)}))
    result = verify(exports["tiny", 0, "float32"], source, RunDir(only0), tmp_path / "v1.json")
    assert result.passed and "sibling run other" in checks(result)["step1-loss-export"].detail
    assert result.step1_loss["logged"] == read_metrics(trained)[0]["loss"]


def test_cli_by_model_and_path_writes_verify_json_in_the_run_dir(runs):
    run_pipeline("export", "--model", "tiny", "--path", "native", "--dtype", "float32", "--force", root=runs)
    result = run_pipeline("verify", "--model", "tiny", "--path", "native", root=runs)
    assert "PASSED" in result.stdout and "round-trip" not in result.stdout and "changed" in result.stdout
    written = json.loads((runs_dir(runs, "tiny", "native") / "verify.json").read_text())
    assert written["passed"] is True and set(written) == SCHEMA
    export = runs_dir(runs, "tiny", "native") / "export"
    card = (export / "README.md").read_text()
    assert f"| verify | passed all {len(written['checks'])} checks; step-1 loss" in card, card
    manifest.check(export)  # the card's new sha256 was recorded with it
    result = run_pipeline("verify", "--model", "tiny", "--path", "native", root=runs)  # verifies again, card included
    assert "PASSED" in result.stdout


def test_tied_source_storing_lm_head_round_trips(runs, tmp_path):
    source = tied_source_with_lm_head(runs, tmp_path)
    run_dir = fake_run(runs, tmp_path, source=source)
    # The trainer's HF save of such a run keeps the head (test_outputs_export trains one): here it is added.
    shard = hf_shard(run_dir, key="model.embed_tokens.weight")
    state = load_file(str(shard))
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}, str(shard), metadata={"format": "pt"})
    index = json.loads((shard.parent / hf_dir.INDEX).read_text())
    index["weight_map"]["lm_head.weight"] = shard.name
    (shard.parent / hf_dir.INDEX).write_text(json.dumps(index))
    record_hashes(shard.parent)
    out = export_stage.export(export_stage.ExportConfig(RunDir(run_dir), dtype="float32"))
    result = verify(out, source, RunDir(run_dir), tmp_path / "verify.json")
    assert result.passed, [c for c in result.checks if not c.passed]
    assert "lm_head.weight present (reference: present)" in checks(result)["keys"].detail


# Bad exports: each fails with a one-line reason and exit status 2, through the CLI.

def broken_copy(exports, tmp_path, model="tiny") -> Path:
    out = tmp_path / "broken"
    shutil.copytree(exports[model, 0, "float32"], out)
    return out


def run_cli(checkpoint: Path, reference: Path, output: Path, capsys) -> tuple[int, str, dict | None]:
    status = main(["verify", "--checkpoint", str(checkpoint), "--reference", str(reference), "--output", str(output)])
    err = capsys.readouterr().err.strip()
    return status, err, json.loads(output.read_text()) if output.exists() else None


def failed(written: dict) -> set[str]:
    return {c["name"] for c in written["checks"] if not c["passed"]}


def shard_of(directory: Path) -> Path:
    return hf_dir.shard_files(directory)[0]


def expect_failure(exports, runs, tmp_path, capsys, broken, match, failing, model="tiny"):
    source = source_dir(runs, model)
    status, err, written = run_cli(broken, source, tmp_path / "v.json", capsys)
    assert status == 2
    assert err.startswith("error: verify failed") and "\n" not in err and match in err, err
    assert written is not None and written["passed"] is False
    assert failing <= failed(written), written["checks"]
    return written


def test_truncated_shard(exports, runs, tmp_path, capsys):
    broken = broken_copy(exports, tmp_path)
    shard = shard_of(broken)
    shard.write_bytes(shard.read_bytes()[:-100])
    expect_failure(exports, runs, tmp_path, capsys, broken, "truncated", {"files"})


def test_index_naming_a_missing_shard(exports, runs, tmp_path, capsys):
    broken = broken_copy(exports, tmp_path)
    shard_of(broken).unlink()
    expect_failure(exports, runs, tmp_path, capsys, broken, "names shards that are missing", {"files"})


def test_shard_not_in_the_index(exports, runs, tmp_path, capsys):
    broken = broken_copy(exports, tmp_path)
    save_file({"x": torch.zeros(1)}, str(broken / "model-extra.safetensors"))
    expect_failure(exports, runs, tmp_path, capsys, broken, "shards not in", {"files"})


def test_pickle_is_refused_never_loaded(exports, runs, tmp_path, capsys):
    broken = broken_copy(exports, tmp_path)
    (broken / "pytorch_model.bin").write_bytes(b"not even a pickle: opening it would fail differently")
    expect_failure(exports, runs, tmp_path, capsys, broken, "pickle-based weight files ['pytorch_model.bin']", {"files"})


def test_config_disagreeing_with_the_tensors(exports, runs, tmp_path, capsys):
    broken = broken_copy(exports, tmp_path)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 96
    (broken / "config.json").write_text(json.dumps(config))
    expect_failure(exports, runs, tmp_path, capsys, broken, "config.json disagrees with the tensors", {"files"})


def test_nan_in_a_tensor(exports, runs, tmp_path, capsys):
    broken = broken_copy(exports, tmp_path)
    shard = broken / json.loads((broken / hf_dir.INDEX).read_text())["weight_map"]["model.norm.weight"]
    state = load_file(str(shard))
    state["model.norm.weight"][0] = float("nan")
    save_file(state, str(shard), metadata={"format": "pt"})
    written = expect_failure(exports, runs, tmp_path, capsys, broken, "", {"finite", "manifest"})
    assert "model.norm.weight" in next(c["detail"] for c in written["checks"] if c["name"] == "finite")


def test_missing_moe_expert_is_caught_on_disk_and_at_load(exports, runs, tmp_path, capsys):
    broken = broken_copy(exports, tmp_path, model="tiny-moe")
    index = json.loads((broken / hf_dir.INDEX).read_text())
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    shard = broken / index["weight_map"].pop(key)
    state = load_file(str(shard))
    del state[key]
    save_file(state, str(shard), metadata={"format": "pt"})
    (broken / hf_dir.INDEX).write_text(json.dumps(index))
    written = expect_failure(exports, runs, tmp_path, capsys, broken, "", {"files"}, model="tiny-moe")
    assert key in next(c["detail"] for c in written["checks"] if c["name"] == "files")


def test_missing_expert_fails_the_load_check_itself(exports, tmp_path):
    """Past the on-disk check, transformers 5 itself must not load it silently either."""
    from pipeline.outputs.verify import Verification, _load

    broken = broken_copy(exports, tmp_path, model="tiny-moe")
    shard = broken / json.loads((broken / hf_dir.INDEX).read_text())["weight_map"][
        "model.layers.0.mlp.experts.1.gate_proj.weight"]
    state = load_file(str(shard))
    del state["model.layers.0.mlp.experts.1.gate_proj.weight"]
    save_file(state, str(shard), metadata={"format": "pt"})
    result = Verification(broken, broken, None, tmp_path / "v.json")
    model, (passed, detail) = _load(result)
    assert model is None and not passed, detail
