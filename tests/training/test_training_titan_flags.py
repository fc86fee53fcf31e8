"""TITAN_ARGS over what the pipeline owns (issue 19, 8; issue 17, 3.5): flags that change the plan or
the run's own files are folded into the settings before the checks and the estimate run, or refused
in one line naming the pipeline's own setting — never trained behind the dry run's back."""

from __future__ import annotations

import re

import pytest

from pipeline.__main__ import main
from pipeline.errors import PipelineError
from pipeline.titan import api
from pipeline.training.resolve import RunRequest, resolve


def _resolve(tmp_path, *flags, model="tiny", target="cpu", nproc=None):
    return resolve(RunRequest(model=model, path="native", target=target, dry_run=True, checkpoints_root=tmp_path,
                              titan_args=tuple(flags), flags={"nproc_per_node": nproc}))


def test_tp_flag_the_heads_do_not_allow_is_refused_before_launch(tmp_path):
    # 3 ranks, TP 3: it divides the world, not tiny's 4 heads (2 kv) — the check sees the flag's degree
    with pytest.raises(PipelineError, match=r"tensor_parallel=3 does not divide the heads"):
        _resolve(tmp_path, "--parallelism.tensor_parallel_degree", "3", nproc=3)
    assert list(tmp_path.rglob("*")) == []


def test_negative_steps_flag_is_refused_naming_steps(tmp_path):
    with pytest.raises(PipelineError) as err:
        _resolve(tmp_path, "--training.steps", "-5")
    assert "TITAN_ARGS --training.steps -5" in err.value.problem and "STEPS" in str(err.value)


@pytest.mark.parametrize("flags, named, fix", [
    (("--checkpoint.folder", "/elsewhere"), "--checkpoint.folder /elsewhere", "PIPELINE_CHECKPOINTS"),
    (("--dump-folder", "/elsewhere"), "--dump_folder /elsewhere", "PIPELINE_CHECKPOINTS"),
    (("--parallelism.pipeline-parallel-degree", "2"), "--parallelism.pipeline_parallel_degree 2", "tensor_parallel"),
    (("--hf-assets-path", "/elsewhere"), "--hf_assets_path /elsewhere", "MODEL="),
])
def test_flags_the_pipeline_owns_are_refused_in_one_line(tmp_path, flags, named, fix):
    with pytest.raises(PipelineError) as err:
        _resolve(tmp_path, *flags)
    assert f"TITAN_ARGS {named}:" in err.value.problem and fix in err.value.fix and "\n" not in str(err.value)


def test_folded_flags_become_the_settings_the_checks_read(tmp_path):
    # One sequence per rank, as the installed torchtitan spells it (main counts tokens: titan.api).
    seq_len = _resolve(tmp_path, "--lr-scheduler.warmup-steps", "0").settings.seq_len
    batch = (f"--training.{api.batch_field().replace('_', '-')}", str(seq_len if api.folded_batch() else 1))
    spec = _resolve(tmp_path, "--training.steps", "1", *batch, "--lr-scheduler.warmup-steps", "0")
    assert (spec.settings.steps, spec.settings.local_batch_size) == (1, 1)
    assert spec.titan_args == ["--training.steps", "1", *batch,
                               "--lr-scheduler.warmup-steps", "0"]  # still applied in the ranks: same values
    untouched = _resolve(tmp_path, "--lr-scheduler.warmup-steps", "0")
    assert untouched.settings == resolve(RunRequest(model="tiny", path="native", target="cpu", dry_run=True,
                                                    checkpoints_root=tmp_path)).settings


def test_every_owned_field_exists_in_torchtitans_config(tmp_path):
    """The table names real fields of the installed torchtitan (a renamed field would silently stop
    being checked)."""
    from pipeline.training import entry, titan_flags

    spec = _resolve(tmp_path)
    config = entry.build_config(spec)
    for owned in titan_flags.owned():
        path = titan_flags._path(config, owned.field)
        assert titan_flags._get(config, path) is not titan_flags._MISSING, path


def test_tp_flag_is_what_the_trn2_dry_run_estimates(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(tmp_path))
    code = main(["train", "--model", "Qwen/Qwen3-4B-Instruct-2507", "--path", "native", "--target", "trn2",
                 "--dry-run", "--titan-args=--parallelism.tensor-parallel-degree 1"])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    (estimate,) = [line for line in out.splitlines() if line.startswith("memory per rank (estimate)")]
    assert re.search(r"; TP 1 × FSDP 64;", estimate), estimate
    assert '"tensor_parallel": 1' in out and "tensor_parallel 4 → 1" in err
