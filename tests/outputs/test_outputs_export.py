"""pipeline/outputs/export.py: a run's HF save (step-N/hf, torchtitan's HF writer) → an HF checkpoint with the
source's keys and shards, linked or cast, atomically; bad saves are refused and a full disk leaves the previous
export intact."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
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
from pipeline.stages import publish
from helpers import (EXPORT_MODELS, REPO, TRAINED_STEPS, copy_model, fake_run, hf_shard, missing_tool, plant_dcp_shards,
                     read_metrics,
                     record_hashes, run_dir as runs_dir, run_pipeline, source_dir, tensors, tied_source_with_lm_head,
                     weights_path)


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
            assert (path / rundir.HF_WEIGHTS).is_dir() and (path / ".metadata").exists()
        assert run.hf_weights() == (TRAINED_STEPS, steps[TRAINED_STEPS] / rundir.HF_WEIGHTS)
        assert run.hf_weights_dtype(TRAINED_STEPS) == "float32"  # the fixture's --export-dtype
        saves = [json.loads(line) for line in run.saves.read_text().splitlines()]
        assert [s["step"] for s in saves] == [0, TRAINED_STEPS]  # both were a run's last step
        for save in saves:
            saved = steps[save["step"]] / rundir.HF_WEIGHTS
            assert save["hf_bytes"] == sum(p.stat().st_size for p in saved.iterdir()) and save["hf_s"] > 0
        assert [m["step"] for m in read_metrics(run.path)] == [1, 2]


def test_the_hf_save_has_the_source_shards_and_nothing_else(export_runs):
    """torchtitan's HF writer keeps the source's file per tensor; DCP's per-rank shards and the temporary
    folder are gone; the step's own files are DCP's alone."""
    for model in EXPORT_MODELS:
        source = source_dir(export_runs, model)
        for step_dir in RunDir(runs_dir(export_runs, model, "native")).checkpoint_steps().values():
            saved = step_dir / rundir.HF_WEIGHTS
            assert sorted(p.name for p in saved.iterdir()) == sorted([rundir.HF_HASHES, *(p.name for p in source.glob("model*"))])
            recorded = json.loads((saved / rundir.HF_HASHES).read_text())  # hashed by the ranks that saved them
            assert {name: r["sha256"] for name, r in recorded.items()} == \
                {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in saved.glob("*.safetensors")}
            assert json.loads((saved / hf_dir.INDEX).read_text())["weight_map"] == \
                json.loads((source / hf_dir.INDEX).read_text())["weight_map"]
            assert not list(step_dir.glob("*.safetensors")) and not list(step_dir.glob(".*.tmp"))


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
    saved = weights_path(runs_dir(export_runs, model, "native"), 0)
    for shard in out.glob("*.safetensors"):  # the saved dtype: linked, not copied
        assert shard.stat().st_ino == (saved / shard.name).stat().st_ino, shard.name
    if model == "tiny-moe":
        assert any(".mlp.experts.3.down_proj.weight" in k for k in ours) and "lm_head.weight" in ours
    else:
        assert "lm_head.weight" not in ours  # tied, and the source does not store it
    written = manifest.check(out)
    assert written["step"] == 0 and written["dtype"] == "float32" and written["saved_dtype"] == "float32"
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
    assert main(["export", "--model", "tiny-moe", "--path", "native", "--force"]) == 0
    out = runs_dir(export_runs, "tiny-moe", "native") / "export"
    index = json.loads((out / hf_dir.INDEX).read_text())
    source_index = json.loads((source_dir(export_runs, "tiny-moe") / hf_dir.INDEX).read_text())
    assert index["weight_map"] == source_index["weight_map"]  # the source's shards
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors(out).values())
    written = manifest.check(out)
    assert written["step"] == TRAINED_STEPS and written["saved_dtype"] == "float32"
    saved = weights_path(runs_dir(export_runs, "tiny-moe", "native"), TRAINED_STEPS)
    for shard in out.glob("*.safetensors"):  # a narrower dtype: cast into new files
        assert shard.stat().st_ino != (saved / shard.name).stat().st_ino
    ours, theirs = tensors(out), tensors(source_dir(export_runs, "tiny-moe"))
    assert set(ours) == set(theirs)
    assert {t.dtype for t in ours.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    changed = [k for k in theirs if not torch.equal(ours[k], theirs[k].to(torch.bfloat16))]
    assert len(changed) > len(theirs) // 2


def test_an_export_is_a_shareable_repository(export_runs, tmp_path):
    """The source's shard names and index; no host path in any file; modes as open/mkdir give."""
    out = tmp_path / "e"
    export(runs_dir(export_runs, "tiny", "native"), dtype="bfloat16", output=out)
    assert sorted(p.name for p in out.glob("model*")) == sorted(p.name for p in source_dir(export_runs, "tiny").glob("model*"))
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


def test_checkpoint_without_its_hf_save_is_refused(export_runs, tmp_path):
    run = fake_run(export_runs, tmp_path)
    shutil.rmtree(weights_path(run))
    with pytest.raises(PipelineError, match="none holds hf/.*cut short"):
        export(run)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # linked and cast: both read every tensor
def test_nan_weights_are_refused(export_runs, tmp_path, dtype):
    run = fake_run(export_runs, tmp_path)
    shard = hf_shard(run)
    state = load_file(str(shard))
    state["model.norm.weight"][3] = float("nan")
    save_file(state, str(shard), metadata={"format": "pt"})
    record_hashes(shard.parent)  # a run that diverged: its ranks saved the NaN
    with pytest.raises(PipelineError, match="model.norm.weight holds NaN"):
        export(run, dtype=dtype)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "run.json"]


def test_truncated_weights_are_refused(export_runs, tmp_path):
    run = fake_run(export_runs, tmp_path)
    path = hf_shard(run)
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(PipelineError, match="damaged.*truncated"):
        export(run)


def test_a_wider_dtype_than_the_run_saved_is_refused(export_runs, tmp_path):
    run = fake_run(export_runs, tmp_path)
    for shard in weights_path(run).glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(shard)).items()}, str(shard), metadata={"format": "pt"})
    record_hashes(weights_path(run))  # as a bfloat16 run's ranks save it
    with pytest.raises(PipelineError, match="saved in bfloat16.*Fix: train with DTYPE=float32"):
        export(run, dtype="float32")
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "run.json"]
    assert manifest.check(export(run, dtype="bfloat16"))["saved_dtype"] == "bfloat16"


def test_interrupted_export_leaves_nothing_that_looks_complete(export_runs, tmp_path, monkeypatch):
    run = fake_run(export_runs, tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_stage, "write_config", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export(run)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "run.json"]


def test_a_stored_tied_lm_head_and_a_single_file_are_kept(checkpoints, tmp_path):
    """A tied source that stores lm_head.weight, in one model.safetensors (as some Hub repos are): the
    trainer's HF save keeps the head (torchtitan's adapter drops it), the export is one file, no index."""
    root = tmp_path / "root"
    copy_model(checkpoints, root)
    source = source_dir(root)
    merged = tied_source_with_lm_head(root, tmp_path)
    for old in source.glob("model*"):
        old.unlink()
    save_file(tensors(merged), str(source / "model.safetensors"), metadata={"format": "pt"})
    run_pipeline("train", "--model", "tiny", "--path", "native", "--steps", "0", "--export-dtype", "float32", root=root)
    out = export(runs_dir(root, "tiny", "native"), dtype="float32")
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    ours = tensors(out)
    assert set(ours) == set(tensors(source))
    assert torch.equal(ours["lm_head.weight"], ours["model.embed_tokens.weight"])
    assert torch.equal(ours["lm_head.weight"], tensors(source)["lm_head.weight"])


def test_source_that_no_longer_matches_the_run_is_refused(export_runs, tmp_path):
    source = tmp_path / "source-moe"
    shutil.copytree(source_dir(export_runs, "tiny-moe"), source)
    run = fake_run(export_runs, tmp_path, source=source)  # tiny's run, tiny-moe's source
    with pytest.raises(PipelineError, match="no longer matches"):
        export(run)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_export_onto_a_full_disk_fails_cleanly(checkpoints, tmp_path):
    # The run lives on a small tmpfs that holds its float32 HF save and a linked float32 export;
    # a bfloat16 export (a cast: new files) does not fit.
    root = tmp_path / "root"
    source_run = tmp_path / "source"
    copy_model(checkpoints, source_run)
    run_pipeline("train", "--model", "tiny", "--path", "native", "--steps", "0", "--fresh", "--export-dtype", "float32",
                 root=source_run)
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
        shutil.copy(trained / "checkpoint" / "step-0" / ".metadata", step / ".metadata")
        shutil.copytree(trained / "checkpoint" / "step-0" / rundir.HF_WEIGHTS, step / rundir.HF_WEIGHTS)
        plant_dcp_shards(trained / "checkpoint" / "step-0", step)
        run_pipeline("export", "--model", "tiny", "--path", "native", "--dtype", "float32", root=root)
        before = {p: sha(p) for p in [*sorted((run / "export").iterdir()), *sorted((step / rundir.HF_WEIGHTS).iterdir())]}
        used = int(subprocess.run(["du", "-sk", str(run)], capture_output=True, text=True).stdout.split()[0])
        subprocess.run(["mount", "-o", f"remount,size={used + 8 * 1024}k", str(run)], check=True)

        result = run_pipeline("export", "--model", "tiny", "--path", "native", "--force", "--dtype", "bfloat16",
                              root=root, check=False)
        assert result.returncode == 2, result.stderr[-2000:]
        err = result.stderr.strip()
        assert "Traceback" not in result.stderr and "\n" not in err, err
        assert err.startswith("error:") and "full disk" in err and "Fix:" in err, err
        assert {p: sha(p) for p in before} == before
        manifest.check(run / "export")
        # no .lock: export held the run's lock while it wrote (as a launch does) and deleted it as it let go
        assert sorted(p.name for p in run.iterdir()) == ["checkpoint", "export", "run.json"]
    finally:
        subprocess.run(["umount", str(run)], check=False)


def test_a_finished_run_saves_its_model_again_in_another_dtype(checkpoints, tmp_path):
    """A run's last step saved in bfloat16 (the default) refuses a float32 export, naming the fix; the fix
    (the same run, DTYPE=float32) trains nothing and saves the model again; more STEPS then resume from
    the last step's full DCP save, and the new last step has its HF save in the dtype asked for."""
    root = copy_model(checkpoints, tmp_path / "root", link=True)
    train = ("train", "--model", "tiny", "--path", "native", "--nproc-per-node", "1")
    run_pipeline(*train, "--steps", "2", root=root)
    run = RunDir(runs_dir(root, "tiny", "native"))
    assert run.hf_weights_dtype(2) == "bfloat16"
    bf16 = tensors(run.step_dir(2) / rundir.HF_WEIGHTS)
    with pytest.raises(PipelineError, match="saved in bfloat16.*DTYPE=float32"):
        export(run.path, dtype="float32")
    logged = run.metrics.read_text()
    run_pipeline(*train, "--steps", "2", "--export-dtype", "float32", root=root)
    assert run.metrics.read_text() == logged and [m["step"] for m in read_metrics(run.path)] == [1, 2]  # nothing trained
    assert run.hf_weights_dtype(2) == "float32"
    fp32 = tensors(run.step_dir(2) / rundir.HF_WEIGHTS)
    assert all(torch.equal(fp32[k].to(torch.bfloat16), bf16[k]) for k in bf16)
    assert manifest.check(export(run.path, dtype="float32"))["saved_dtype"] == "float32"
    more = run_pipeline(*train, "--steps", "3", "--export-dtype", "float32", root=root)
    logs = more.stdout + more.stderr
    assert f"Loading the checkpoint from {run.path}/checkpoint/step-2" in logs and "Training starts at step 3" in logs
    assert [m["step"] for m in read_metrics(run.path)] == [1, 2, 3]
    assert run.hf_weights() == (3, run.step_dir(3) / rundir.HF_WEIGHTS) and run.hf_weights_dtype(3) == "float32"


def transformers4_source(export_runs: Path, tmp_path: Path) -> Path:
    """tiny's source with its config.json as transformers 4.x wrote it (Qwen3-4B-Instruct-2507's Hub config
    is one: top-level rope_theta and rope_scaling, torch_dtype, transformers_version 4.51.0), plus a key
    no transformers knows; the same architecture, so a tiny run exports over it."""
    source = tmp_path / "source-4x"
    shutil.copytree(source_dir(export_runs, "tiny"), source)
    config = json.loads((source / "config.json").read_text())
    config.pop("dtype")
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config.update(rope_scaling=None, torch_dtype="bfloat16", transformers_version="4.51.0", team_note="kept")
    (source / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return source


def test_a_transformers4_config_keeps_every_key_and_only_its_dtype_changes(export_runs, tmp_path):
    """Every top-level key and value of the source's config.json, in its spelling (torch_dtype, not
    dtype; rope_theta, not rope_parameters); the generation config and tokenizer byte for byte."""
    source = transformers4_source(export_runs, tmp_path)
    run = fake_run(export_runs, tmp_path, source=source)
    out = export(run, dtype="float32", step=0, output=tmp_path / "e")
    theirs, ours = json.loads((source / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert list(ours) == list(theirs)  # no key added (dtype, rope_parameters) or lost, in the source's order
    assert {k: v for k, v in ours.items() if k != "torch_dtype"} == {k: v for k, v in theirs.items() if k != "torch_dtype"}
    assert ours["torch_dtype"] == "float32" and ours["rope_theta"] == 1e6 and ours["rope_scaling"] is None
    for name in hf_dir.CARRIED_FILES:
        if (source / name).exists():
            assert (out / name).read_bytes() == (source / name).read_bytes(), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_shard_has_save_pretrained_format_metadata(export_runs, tmp_path, dtype):
    """{"format": "pt"} in every shard's header, as safetensors' save_file writes it: the trainer's HF save
    carries it (so the export links it), a save from before that gets a marked copy with the same tensors."""
    from pipeline.checkpoint import stream

    run = fake_run(export_runs, tmp_path)
    saved = weights_path(run, 0)
    assert all(stream.has_pt_format(shard) for shard in saved.glob("*.safetensors"))
    unmarked = {}
    for shard in saved.glob("*.safetensors"):  # as torch's consolidation writes it: no __metadata__
        unmarked[shard.name] = load_file(str(shard))
        save_file(unmarked[shard.name], str(shard))
        assert not stream.has_pt_format(shard)
    # as the trainer recorded them when it saved them so
    (saved / rundir.HF_HASHES).write_text(json.dumps({
        shard.name: {"sha256": sha(shard), "bytes": shard.stat().st_size, "mtime_ns": shard.stat().st_mtime_ns}
        for shard in saved.glob("*.safetensors")}))
    out = export(run, dtype=dtype, step=0, output=tmp_path / "e")
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) == 2
    for shard in shards:
        assert stream.header_metadata(shard) == {"format": "pt"}, shard.name
        assert shard.stat().st_ino != (saved / shard.name).stat().st_ino
        ours, theirs = load_file(str(shard)), unmarked[shard.name]
        assert set(ours) == set(theirs)
        assert all(torch.equal(ours[k], theirs[k].to(getattr(torch, dtype))) for k in theirs)
    # a marked copy is no file of the run's save: publishable, though its sha256 is not the recorded one
    publish._check_linked_weights(RunDir(run), out, manifest.check(out), "again")


# transformers 4.57, the last 4.x (serving stacks still pin it), over the dev venv: `make setup-transformers4`.
TRANSFORMERS4 = REPO / ".venv-transformers4" / "bin" / "python"


def client_logits(python: Path | str, model_dir: Path, out: Path) -> tuple[dict, torch.Tensor]:
    """What tests/client_logits.py, run by `python`, read from `model_dir`: its report and the logits."""
    result = subprocess.run([str(python), str(REPO / "tests" / "client_logits.py"), str(model_dir), str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), load_file(str(out))["logits"]


def test_transformers4_reads_the_export_as_transformers5_does(export_runs, tmp_path):
    """An export of a transformers-4.x-written source (the Hub's Qwen3 configs): transformers 4.57 finds the
    same rope_theta as 5.16 (1e6, not Qwen3Config's default 10000) and the same logits."""
    if not TRANSFORMERS4.exists():
        missing_tool(f"no transformers 4.57 venv at {TRANSFORMERS4.parent.parent}: `make setup-transformers4` "
                     "makes it (`make test` does)")
    run = fake_run(export_runs, tmp_path, step=TRAINED_STEPS, source=transformers4_source(export_runs, tmp_path))
    out = export(run, dtype="float32", output=tmp_path / "e")
    new, new_logits = client_logits(sys.executable, out, tmp_path / "new.safetensors")
    old, old_logits = client_logits(TRANSFORMERS4, out, tmp_path / "old.safetensors")
    assert new["transformers"].startswith("5.") and old["transformers"].startswith("4.57."), (new, old)
    assert old["rope_theta"] == new["rope_theta"] == 1e6
    assert old_logits.shape == new_logits.shape and old_logits.shape[-1] == 151936
    assert torch.allclose(old_logits, new_logits, atol=1e-5, rtol=0), (old_logits - new_logits).abs().max()
