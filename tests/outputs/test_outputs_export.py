"""pipeline/stages/export.py: a run's checkpoint → HF safetensors, with the source's keys, atomically;
bad checkpoints are refused and a full disk leaves the previous export intact."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.__main__ import main
from pipeline.checkpoint import hf_dir, manifest
from pipeline.errors import PipelineError
from pipeline.run import rundir
from pipeline.run.rundir import RunDir
from pipeline.outputs import export as export_stage
from helpers import (EXPORT_MODELS, TRAINED_STEPS, copy_model, fake_run, plant_dcp_shards, read_metrics, run_dir as runs_dir,
                           run_pipeline, source_dir, tensors, tied_source_with_lm_head, weights_path)


CURRENT_UMASK = os.umask(0o022)
os.umask(CURRENT_UMASK)


def export(run: Path, **kwargs) -> Path:
    return export_stage.export(export_stage.ExportConfig(RunDir(run), **kwargs))


def test_trainer_wrote_step0_and_step2_weights(export_runs):
    for model in EXPORT_MODELS:
        run = RunDir(runs_dir(export_runs, model, "native"))
        steps = run.checkpoint_steps()
        assert sorted(steps) == [0, TRAINED_STEPS]
        for path in steps.values():
            assert (path / rundir.WEIGHTS).exists() and (path / ".metadata").exists()
        assert run.weights_file() == (TRAINED_STEPS, steps[TRAINED_STEPS] / rundir.WEIGHTS)
        assert [m["step"] for m in read_metrics(run.path)] == [1, 2]


def test_weights_file_name_matches_the_trainer(export_runs):
    """The one safetensors file the real trainer writes beside each DCP step is the one export reads."""
    for model in EXPORT_MODELS:
        for step_dir in RunDir(runs_dir(export_runs, model, "native")).checkpoint_steps().values():
            assert [p.name for p in step_dir.glob("*.safetensors")] == [rundir.WEIGHTS]


@pytest.mark.parametrize("model", EXPORT_MODELS)
def test_step0_export_is_bitwise_the_source(export_runs, tmp_path, model):
    out = export(runs_dir(export_runs, model, "native"), dtype="float32", step=0, output=tmp_path / "e")
    source = source_dir(export_runs, model)
    ours, theirs = tensors(out), tensors(source)
    assert set(ours) == set(theirs)  # MoE: the Hub's per-expert keys, exactly the source's
    for key in theirs:
        assert ours[key].dtype == torch.float32
        assert torch.equal(ours[key], theirs[key]), key
    report = hf_dir.validate(out)
    assert report.arch == hf_dir.validate(source).arch
    if model == "tiny-moe":
        assert any(".mlp.experts.3.down_proj.weight" in k for k in ours) and "lm_head.weight" in ours
    else:
        assert "lm_head.weight" not in ours  # tied, and the source does not store it
    written = manifest.check(out)
    assert written["step"] == 0 and written["dtype"] == "float32"
    assert set(written["files"]) == {p.name for p in out.iterdir()} - {manifest.MANIFEST}
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


def test_default_export_is_bf16_of_the_last_step(export_runs, monkeypatch):
    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(export_runs))
    assert main(["export", "--model", "tiny-moe", "--path", "native", "--max-shard-size", "10MB", "--force"]) == 0
    out = runs_dir(export_runs, "tiny-moe", "native") / "export"
    index = json.loads((out / hf_dir.INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1  # the shard-size limit was applied
    written = manifest.check(out)
    assert written["step"] == TRAINED_STEPS
    ours, theirs = tensors(out), tensors(source_dir(export_runs, "tiny-moe"))
    assert set(ours) == set(theirs)
    assert {t.dtype for t in ours.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    changed = [k for k in theirs if not torch.equal(ours[k], theirs[k].to(torch.bfloat16))]
    assert len(changed) > len(theirs) // 2


def test_an_export_is_a_shareable_repository(export_runs, tmp_path):
    """One shard is save_pretrained's single file; no host path in any file; modes as open/mkdir give."""
    out = tmp_path / "e"
    export(runs_dir(export_runs, "tiny", "native"), dtype="bfloat16", output=out)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / hf_dir.INDEX).exists()
    for file in out.iterdir():
        assert str(export_runs) not in file.read_text(errors="replace"), file.name
        assert stat.S_IMODE(file.stat().st_mode) == 0o666 & ~CURRENT_UMASK, file.name
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~CURRENT_UMASK
    assert manifest.check(out)["run"] == "native"


def test_existing_export_is_refused_and_force_replaces_it(export_runs, tmp_path):
    run = runs_dir(export_runs, "tiny", "native")
    out = tmp_path / "e"
    export(run, dtype="float32", step=0, output=out)
    before = (out / manifest.MANIFEST).read_text()
    with pytest.raises(PipelineError, match="already exists"):
        export(run, dtype="bfloat16", output=out)
    assert (out / manifest.MANIFEST).read_text() == before
    export(run, dtype="bfloat16", output=out, force=True)
    assert json.loads((out / manifest.MANIFEST).read_text())["step"] == TRAINED_STEPS
    assert [p.name for p in tmp_path.iterdir()] == ["e"]  # no temp or old folder left


def test_cli_refusal_is_one_line_and_nonzero(export_runs, monkeypatch, capsys):
    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(export_runs))
    out = runs_dir(export_runs, "tiny", "native") / "export"
    out.mkdir(exist_ok=True)
    assert main(["export", "--model", "tiny", "--path", "native"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error:") and "already exists" in err
    assert list(out.iterdir()) == []
    shutil.rmtree(out)


def test_run_without_checkpoint_is_refused(export_runs, tmp_path):
    run = fake_run(export_runs, tmp_path)
    shutil.rmtree(run / "checkpoint")
    with pytest.raises(PipelineError, match="no checkpoint yet"):
        export(run)
    assert not (run / "export").exists()
    with pytest.raises(PipelineError, match="no run"):
        export(tmp_path / "nothing")


def test_checkpoint_without_weights_file_is_refused(export_runs, tmp_path):
    run = fake_run(export_runs, tmp_path)
    weights_path(run).unlink()
    with pytest.raises(PipelineError, match="none holds model_weights.safetensors"):
        export(run)


def test_nan_weights_are_refused(export_runs, tmp_path):
    run = fake_run(export_runs, tmp_path)
    state = load_file(str(weights_path(run)))
    state["norm.weight"][3] = float("nan")
    save_file(state, str(weights_path(run)))
    with pytest.raises(PipelineError, match="norm.weight holds NaN"):
        export(run)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "run.json"]


def test_truncated_weights_are_refused(export_runs, tmp_path):
    run = fake_run(export_runs, tmp_path)
    path = weights_path(run)
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(PipelineError, match="truncated"):
        export(run)


def test_interrupted_export_leaves_nothing_that_looks_complete(export_runs, tmp_path, monkeypatch):
    run = fake_run(export_runs, tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_stage, "write_config", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export(run)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "run.json"]


def test_tied_lm_head_is_written_exactly_when_the_source_has_it(export_runs, tmp_path):
    source = tied_source_with_lm_head(export_runs, tmp_path)
    run = fake_run(export_runs, tmp_path, source=source)
    out = export(run, dtype="float32")
    ours = tensors(out)
    assert set(ours) == set(tensors(source))
    assert torch.equal(ours["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_source_that_no_longer_matches_the_run_is_refused(export_runs, tmp_path):
    source = tmp_path / "source-moe"
    shutil.copytree(source_dir(export_runs, "tiny-moe"), source)
    run = fake_run(export_runs, tmp_path, source=source)  # tiny's run, tiny-moe's source
    with pytest.raises(PipelineError, match="no longer matches"):
        export(run)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_export_onto_a_full_disk_fails_cleanly(checkpoints, tmp_path):
    # The run lives on a small tmpfs that holds the source checkpoint and one bf16 export;
    # the float32 export does not fit.
    root = tmp_path / "root"
    source_run = tmp_path / "source"
    copy_model(checkpoints, source_run)
    run_pipeline("train", "--model", "tiny", "--path", "native", "--steps", "0", "--fresh", root=source_run)
    trained = runs_dir(source_run, "tiny", "native")
    shutil.copytree(source_run / "tiny", root / "tiny", ignore=shutil.ignore_patterns("runs"))
    run = runs_dir(root, "tiny", "native")
    run.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200m", "tmpfs", str(run)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        shutil.copy(trained / "run.json", run / "run.json")
        step = run / "checkpoint" / "step-0"
        step.mkdir(parents=True)
        for name in (".metadata", rundir.WEIGHTS):
            shutil.copy(trained / "checkpoint" / "step-0" / name, step / name)
        plant_dcp_shards(trained / "checkpoint" / "step-0", step)
        run_pipeline("export", "--model", "tiny", "--path", "native", root=root)
        before = {p: sha(p) for p in [*sorted((run / "export").iterdir()), step / rundir.WEIGHTS]}
        used = int(subprocess.run(["du", "-sk", str(run)], capture_output=True, text=True).stdout.split()[0])
        subprocess.run(["mount", "-o", f"remount,size={used + 8 * 1024}k", str(run)], check=True)

        result = run_pipeline("export", "--model", "tiny", "--path", "native", "--force", "--dtype", "float32",
                              root=root, check=False)
        assert result.returncode == 2, result.stderr[-2000:]
        err = result.stderr.strip()
        assert "Traceback" not in result.stderr and "\n" not in err, err
        assert err.startswith("error:") and "full disk" in err and "Fix:" in err, err
        assert {p: sha(p) for p in before} == before
        manifest.check(run / "export")
        # .lock: the run's lock, which export holds while it writes (as a launch does)
        assert sorted(p.name for p in run.iterdir()) == [".lock", "checkpoint", "export", "run.json"]
    finally:
        subprocess.run(["umount", str(run)], check=False)
