"""pipeline/__main__.py: a survey of bad inputs across stages, run exactly as a user runs them: each
must give one line `error: … Fix: …`, exit status 2, no traceback (unless --debug), and leave no
output behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import copy_model, run_pipeline, source_dir

TRAIN = ("train", "--model", "tiny", "--path", "native")


def _copy(root: Path, checkpoints: Path) -> None:
    copy_model(checkpoints, root, "tiny")


def _config(root: Path, text: str) -> str:
    path = root.parent / f"{root.name}.toml"
    path.write_text(text)
    return str(path)


def no_tokenizer(root, ck):
    _copy(root, ck)
    (source_dir(root) / "tokenizer.json").unlink()
    return TRAIN, "lacks tokenizer files"


def missing_shard(root, ck):
    _copy(root, ck)
    next(source_dir(root).glob("model-00002-*.safetensors")).unlink()
    return TRAIN, "names shards that are missing"


def truncated_shard(root, ck):
    _copy(root, ck)
    shard = next(source_dir(root).glob("model-00001-*.safetensors"))
    os.truncate(shard, shard.stat().st_size // 2)
    return TRAIN, "is truncated"


def config_typo(root, ck):
    _copy(root, ck)
    return (*TRAIN, "--dry-run", "--config", _config(root, "[train]\nstep = 3\n")), "did you mean steps?"


def wrong_type(root, ck):
    _copy(root, ck)
    return (*TRAIN, "--dry-run", "--config", _config(root, '[train]\nsteps = "ten"\n')), "expected int"


def conflicting_parallelism(root, ck):
    _copy(root, ck)
    config = _config(root, "[train]\ndata_parallel_shard = 4\n")
    return (*TRAIN, "--dry-run", "--config", config, "--nproc-per-node", "2"), "data_parallel_shard=4"


def unknown_model(root, ck):
    return ("train", "--model", "someorg/nosuch", "--path", "native", "--dry-run"), "'someorg/nosuch' is not downloaded"


def config_only_model_download(root, ck):
    return ("download", "--model", "Qwen3-MoE-trn2-fit"), "is only a config.json"


def config_only_model_train(root, ck):
    return ("train", "--model", "Qwen3-MoE-trn2-fit", "--path", "nki"), "it can be dry-run, not downloaded or trained"


def model_path_missing(root, ck):
    return ("download", "--model", str(root / "no" / "such" / "dir")), "is not an existing directory"


def root_not_writable(root, ck):
    root.parent.joinpath("a-file").write_text("x")
    os.environ["_BAD_ROOT"] = str(root.parent / "a-file" / "ckpt")
    return ("download", "--model", "tiny"), "has a file where a directory is needed"


def steps_negative(root, ck):
    _copy(root, ck)
    return (*TRAIN, "--steps", "-3"), "STEPS=-3 is negative"


def steps_not_a_number(root, ck):
    return (*TRAIN, "--steps", "ten"), "invalid int value: 'ten'"


def seq_len_zero(root, ck):
    _copy(root, ck)
    return (*TRAIN, "--seq-len", "0", "--dry-run"), "SEQ_LEN=0 must be at least 1"


def unknown_target(root, ck):
    return (*TRAIN, "--target", "tpu", "--dry-run"), "TARGET='tpu' is unknown"


def trn2_without_neuron(root, ck):
    if list(Path("/dev").glob("neuron*")):
        pytest.skip("this machine has Neuron devices")
    _copy(root, ck)
    return (*TRAIN, "--target", "trn2"), "no /dev/neuron* devices"


def nki_constraint_broken(root, ck):
    return ("train", "--model", "Qwen3-MoE-trn2-fit", "--path", "nki", "--target", "trn2", "--seq-len", "100",
            "--dry-run"), "multiple of 128 × LNC = 256"


def export_without_run(root, ck):
    _copy(root, ck)
    return ("export", "--model", "tiny", "--path", "native"), "no run there"


def unknown_flag(root, ck):
    return (*TRAIN, "--stpes", "3"), "unrecognized arguments: --stpes"


CASES = [no_tokenizer, missing_shard, truncated_shard, config_typo, wrong_type, conflicting_parallelism,
         unknown_model, config_only_model_download, config_only_model_train, model_path_missing, root_not_writable, steps_negative, steps_not_a_number, seq_len_zero,
         unknown_target, trn2_without_neuron, nki_constraint_broken, export_without_run,
         unknown_flag]


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")} if root.exists() else {}


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
def test_bad_input_is_one_line_with_a_fix(case, checkpoints, tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    monkeypatch.delenv("_BAD_ROOT", raising=False)
    args, problem = case(root, checkpoints)
    root = Path(os.environ.pop("_BAD_ROOT", root))
    before = tree(root)
    result = run_pipeline(*args, root=root, check=False, timeout=300)
    err = result.stderr.strip()
    assert result.returncode == 2, f"status {result.returncode}: {result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr and "\n" not in err, err
    assert err.startswith("error:") and "Fix:" in err and problem in err, err
    assert tree(root) == before, "the failed stage left output behind"


def test_debug_shows_the_traceback(checkpoints, tmp_path):
    result = run_pipeline(*TRAIN, "--target", "tpu", "--dry-run", "--debug", root=tmp_path, check=False)
    assert result.returncode != 0 and "Traceback" in result.stderr and "PipelineError" in result.stderr


def test_then_runs_stages_in_order_in_one_process_after_parsing_them_all(tmp_path):
    """`--then <stage>` chains stages (make export-verify): a bad later command line stops before the first stage
    runs; a failing stage stops the chain with its own status."""
    from helpers import cli

    listed = cli("paths", root=tmp_path).stdout
    assert listed and cli("paths", "--then", "paths", root=tmp_path).stdout == listed * 2
    bad_later = cli("paths", "--then", "paths", "--no-such-flag", root=tmp_path)
    assert bad_later.returncode == 2 and bad_later.stdout == "" and "--no-such-flag" in bad_later.stderr
    failing_first = cli("verify", "--then", "paths", root=tmp_path)
    assert failing_first.returncode == 2 and failing_first.stdout == ""
    assert failing_first.stderr.startswith("error: verify needs --model")
    # `--then` followed by no stage, or by a word that is none, is refused naming the stages, before anything runs
    for tail in ([], ["bogus"], ["--model", "tiny"]):
        refused = cli("paths", "--then", *tail, root=tmp_path)
        assert refused.returncode == 2 and refused.stdout == "", tail
        assert f"--then is followed by {repr(tail[0]) if tail else 'nothing'}, not a stage" in refused.stderr
        assert "the stages: " in refused.stderr and "export, " in refused.stderr
