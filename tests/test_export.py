"""`make export`: a run's checkpoint → HF safetensors, with the source's keys, atomically."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import read_metrics, run_pipeline
from pipeline import export as export_stage
from pipeline import hf_checkpoint
from pipeline.__main__ import main
from pipeline.errors import PipelineError

MODELS = ("tiny", "tiny-moe")
# Two gloo ranks for tiny (FSDP-sharded weights gathered into the safetensors copy), one for
# tiny-moe (keeps the session short on 2 cores).
NPROC = {"tiny": "2", "tiny-moe": "1"}
TRAINED_STEPS = 2


def export_runs(checkpoints: Path, base: Path) -> Path:
    """A checkpoints root of its own (the shared one's hf/data linked in) with, per model, a native
    run that ran STEPS=0 and then resumed to STEPS=2: its checkpoint/ keeps step-0 and step-2.
    Idempotent, so test_verify's session fixture reuses what test_export's made."""
    root = base / "export-runs"
    done = root / ".done"
    if done.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    for model in MODELS:
        (root / model).mkdir(parents=True)
        for sub in ("hf", "data"):
            os.symlink(checkpoints / model / sub, root / model / sub)
        for steps in ("0", str(TRAINED_STEPS)):
            run_pipeline("train", "--model", model, "--path", "native", "--steps", steps,
                         "--nproc-per-node", NPROC[model], root=root)
    done.write_text("ok\n")
    return root


@pytest.fixture(scope="session")
def runs(checkpoints, tmp_path_factory) -> Path:
    return export_runs(checkpoints, tmp_path_factory.getbasetemp())


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in hf_checkpoint.shard_files(directory):
        out |= load_file(str(shard))
    return out


def test_trainer_wrote_step0_and_step2_weights(runs):
    for model in MODELS:
        steps = export_stage.checkpoint_steps(runs / model / "native")
        assert sorted(steps) == [0, TRAINED_STEPS]
        for path in steps.values():
            assert (path / export_stage.WEIGHTS_FILE).exists() and (path / ".metadata").exists()
        assert [m["step"] for m in read_metrics(runs / model / "native")] == [1, 2]


def test_weights_file_name_matches_the_trainer():
    from pipeline.titan_trainer import WEIGHTS_FILE

    assert export_stage.WEIGHTS_FILE == WEIGHTS_FILE


@pytest.mark.parametrize("model", MODELS)
def test_step0_export_is_bitwise_the_source(runs, tmp_path, model):
    run_dir = runs / model / "native"
    out = export_stage.export(export_stage.ExportConfig(run_dir, dtype="fp32", step=0, output=tmp_path / "e"))
    source = runs / model / "hf"
    ours, theirs = tensors(out), tensors(source)
    assert set(ours) == set(theirs)  # MoE: the Hub's per-expert keys, exactly the source's
    for key in theirs:
        assert ours[key].dtype == torch.float32
        assert torch.equal(ours[key], theirs[key]), key
    report = hf_checkpoint.validate(out)
    assert report.arch == hf_checkpoint.validate(source).arch
    if model == "tiny-moe":
        assert any(".mlp.experts.3.down_proj.weight" in k for k in ours) and "lm_head.weight" in ours
    else:
        assert "lm_head.weight" not in ours  # tied, and the source does not store it
    manifest = export_stage.check_manifest(out)
    assert manifest["step"] == 0 and manifest["dtype"] == "float32"
    assert set(manifest["files"]) == {p.name for p in out.iterdir()} - {export_stage.MANIFEST}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (source / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and "rope_parameters" in config
    assert config["tie_word_embeddings"] is (model == "tiny")
    source_config = json.loads((source / "config.json").read_text())
    for key in ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
        assert config.get(key) == source_config.get(key), key
    if model == "tiny-moe":
        assert config["num_local_experts"] == 4 and config["num_experts_per_tok"] == 2


def test_default_export_is_bf16_of_the_last_step(runs, monkeypatch):
    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(runs))
    assert main(["export", "--model", "tiny-moe", "--run", "native", "--max-shard-size", "10MB", "--force"]) == 0
    out = runs / "tiny-moe" / "native" / "export"
    index = json.loads((out / hf_checkpoint.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1  # the shard-size limit was applied
    manifest = export_stage.check_manifest(out)
    assert manifest["step"] == TRAINED_STEPS
    ours, theirs = tensors(out), tensors(runs / "tiny-moe" / "hf")
    assert set(ours) == set(theirs)
    assert {t.dtype for t in ours.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    changed = [k for k in theirs if not torch.equal(ours[k], theirs[k].to(torch.bfloat16))]
    assert len(changed) > len(theirs) // 2


def test_existing_export_is_refused_and_force_replaces_it(runs, tmp_path):
    run_dir = runs / "tiny" / "native"
    out = tmp_path / "e"
    export_stage.export(export_stage.ExportConfig(run_dir, dtype="fp32", step=0, output=out))
    before = (out / export_stage.MANIFEST).read_text()
    with pytest.raises(PipelineError, match="already exists"):
        export_stage.export(export_stage.ExportConfig(run_dir, dtype="bf16", output=out))
    assert (out / export_stage.MANIFEST).read_text() == before
    export_stage.export(export_stage.ExportConfig(run_dir, dtype="bf16", output=out, force=True))
    assert json.loads((out / export_stage.MANIFEST).read_text())["step"] == TRAINED_STEPS
    assert [p.name for p in tmp_path.iterdir()] == ["e"]  # no temp or old folder left


def test_cli_refusal_is_one_line_and_nonzero(runs, monkeypatch, capsys):
    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(runs))
    out = runs / "tiny" / "native" / "export"
    out.mkdir(exist_ok=True)
    assert main(["export", "--model", "tiny", "--run", "native"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error:") and "already exists" in err
    assert list(out.iterdir()) == []
    shutil.rmtree(out)


def fake_run(runs: Path, tmp_path: Path, model: str = "tiny", step: int = 0, hf_dir: Path | None = None) -> Path:
    """A run dir with the real run.json and one checkpoint's weights file, for editing."""
    src = runs / model / "native"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = json.loads((src / "run.json").read_text())
    spec["run_dir"] = str(run_dir)
    if hf_dir is not None:
        spec["hf_dir"] = str(hf_dir)
    (run_dir / "run.json").write_text(json.dumps(spec))
    (run_dir / "checkpoint" / f"step-{step}").mkdir(parents=True)
    shutil.copy(src / "checkpoint" / f"step-{step}" / export_stage.WEIGHTS_FILE,
                run_dir / "checkpoint" / f"step-{step}" / export_stage.WEIGHTS_FILE)
    return run_dir


def weights_path(run_dir: Path, step: int = 0) -> Path:
    return run_dir / "checkpoint" / f"step-{step}" / export_stage.WEIGHTS_FILE


def test_run_without_checkpoint_is_refused(runs, tmp_path):
    run_dir = fake_run(runs, tmp_path)
    shutil.rmtree(run_dir / "checkpoint")
    with pytest.raises(PipelineError, match="no checkpoint yet"):
        export_stage.export(export_stage.ExportConfig(run_dir))
    assert not (run_dir / "export").exists()
    with pytest.raises(PipelineError, match="no run"):
        export_stage.export(export_stage.ExportConfig(tmp_path / "nothing"))


def test_checkpoint_without_weights_file_is_refused(runs, tmp_path):
    run_dir = fake_run(runs, tmp_path)
    weights_path(run_dir).unlink()
    with pytest.raises(PipelineError, match="has no model_weights.safetensors"):
        export_stage.export(export_stage.ExportConfig(run_dir))


def test_nan_weights_are_refused(runs, tmp_path):
    run_dir = fake_run(runs, tmp_path)
    state = load_file(str(weights_path(run_dir)))
    state["norm.weight"][3] = float("nan")
    save_file(state, str(weights_path(run_dir)))
    with pytest.raises(PipelineError, match="norm.weight holds NaN"):
        export_stage.export(export_stage.ExportConfig(run_dir))
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint", "run.json"]


def test_truncated_weights_are_refused(runs, tmp_path):
    run_dir = fake_run(runs, tmp_path)
    path = weights_path(run_dir)
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(PipelineError, match="truncated"):
        export_stage.export(export_stage.ExportConfig(run_dir))


def test_interrupted_export_leaves_nothing_that_looks_complete(runs, tmp_path, monkeypatch):
    run_dir = fake_run(runs, tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_stage, "write_config", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_stage.export(export_stage.ExportConfig(run_dir))
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint", "run.json"]


def tied_source_with_lm_head(runs: Path, tmp_path: Path) -> Path:
    """tiny's source with lm_head.weight stored (as some tied Hub checkpoints do), in its own shard."""
    source = tmp_path / "hf-with-head"
    shutil.copytree(runs / "tiny" / "hf", source)
    embed = tensors(source)["model.embed_tokens.weight"]
    save_file({"lm_head.weight": embed.clone()}, str(source / "lm_head.safetensors"), metadata={"format": "pt"})
    index = json.loads((source / hf_checkpoint.INDEX).read_text())
    index["weight_map"]["lm_head.weight"] = "lm_head.safetensors"
    (source / hf_checkpoint.INDEX).write_text(json.dumps(index))
    return source


def test_tied_lm_head_is_written_exactly_when_the_source_has_it(runs, tmp_path):
    source = tied_source_with_lm_head(runs, tmp_path)
    run_dir = fake_run(runs, tmp_path, hf_dir=source)
    out = export_stage.export(export_stage.ExportConfig(run_dir, dtype="fp32"))
    ours = tensors(out)
    assert set(ours) == set(tensors(source))
    assert torch.equal(ours["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_source_that_no_longer_matches_the_run_is_refused(runs, tmp_path):
    source = tmp_path / "hf-moe"
    shutil.copytree(runs / "tiny-moe" / "hf", source)
    run_dir = fake_run(runs, tmp_path, hf_dir=source)  # tiny's run, tiny-moe's source
    with pytest.raises(PipelineError, match="no longer matches"):
        export_stage.export(export_stage.ExportConfig(run_dir))
