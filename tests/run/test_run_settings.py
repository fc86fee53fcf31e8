"""pipeline/run/settings.py: configs layer (target defaults, a user's file, flags); bad keys, types
and values are refused naming file and key."""

from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.models import registry
from pipeline.run import settings

PATHS = registry.names()


def load(target: str, path: str, user_config: Path | None = None) -> settings.TrainSettings:
    return settings.load(target, path, PATHS, user_config)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "x.toml"
    path.write_text(text)
    return path


def test_shipped_configs_load_for_every_path():
    for target in ("cpu", "trn2", "cuda"):
        for path in PATHS:
            cfg = load(target, path)
            assert cfg.steps > 0 and cfg.nproc_per_node >= 1
    assert load("trn2", "native").nproc_per_node == 64
    assert load("trn2", "native").lnc == 2


def test_unknown_key_names_file_key_and_allowed(tmp_path):
    path = write(tmp_path, "[train]\nstpes = 3\n")
    with pytest.raises(PipelineError) as err:
        load("cpu", "native", path)
    message = str(err.value)
    assert str(path) in message and "'stpes'" in message and "steps" in message and "allowed:" in message


def test_wrong_type_and_bad_choice(tmp_path):
    with pytest.raises(PipelineError, match="steps = 'ten' is a str, expected int"):
        load("cpu", "native", write(tmp_path, "[train]\nsteps = 'ten'\n"))
    with pytest.raises(PipelineError, match="allowed: float32, bfloat16"):
        load("cpu", "native", write(tmp_path, "[train]\ndtype = 'fp8'\n"))
    with pytest.raises(PipelineError, match=r"unknown table \[paths.foo\]"):
        load("cpu", "native", write(tmp_path, "[paths.foo]\nsteps = 1\n"))
    with pytest.raises(PipelineError, match="not valid TOML"):
        load("cpu", "native", write(tmp_path, "[train\n"))


def test_path_table_overrides_train_table(tmp_path):
    path = write(tmp_path, "[train]\nsteps = 3\n[paths.hf]\nsteps = 7\n")
    assert load("cpu", "native", path).steps == 3
    assert load("cpu", "hf", path).steps == 7


def test_command_line_values_are_checked():
    base = load("cpu", "native")
    assert settings.with_flags(base, steps=4, seq_len=None).steps == 4
    with pytest.raises(PipelineError, match="STEPS=-1 is negative"):
        settings.with_flags(base, steps=-1)
    with pytest.raises(PipelineError, match="SEQ_LEN=0"):
        settings.with_flags(base, seq_len=0)
