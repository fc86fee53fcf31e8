"""Config layering: configs/<target>.toml, then a user's --config/CONFIG= over it key by key (a key
the user does not set keeps the target's value, never the dataclass default), then flags."""

from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.run import settings
from helpers import cli, dry_run_spec
from tiny_checkpoint import ok

PATHS = ("hf", "native", "nki")


def target_values(target: str, path: str = "native") -> dict:
    """The target's settings: TrainSettings' defaults, its [train], its [paths.<path>]."""
    data = tomllib.loads((settings.CONFIG_DIR / f"{target}.toml").read_text())
    return {**settings.to_dict(settings.TrainSettings()), **data["train"], **data.get("paths", {}).get(path, {})}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mine.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("target", ["cpu", "cuda", "trn2"])
def test_user_file_overrides_key_by_key(tmp_path, target):
    user = write(tmp_path, "[train]\nsteps = 3\nseed = 7\n")
    layered = settings.load(target, "native", PATHS, user)
    expected = {**target_values(target), "steps": 3, "seed": 7}
    for key, value in expected.items():
        assert getattr(layered, key) == value, key
    defaults = settings.TrainSettings()
    # the test means something: the target sets keys to values other than the dataclass defaults
    assert any(getattr(defaults, k) != v for k, v in target_values(target).items() if k not in ("steps", "seed"))


def test_a_default_lives_in_one_place():
    """configs/cpu.toml holds only what differs from TrainSettings' defaults: a value there equal to the
    default would be a second home for it (and would go stale when the default changes)."""
    defaults = settings.TrainSettings()
    data = tomllib.loads((settings.CONFIG_DIR / "cpu.toml").read_text())
    tables = [data["train"], *data.get("paths", {}).values()]
    repeated = [k for table in tables for k, v in table.items() if getattr(defaults, k) == v]
    assert not repeated, f"configs/cpu.toml repeats TrainSettings' defaults: {repeated}"
    assert data["train"], "configs/cpu.toml sets nothing: the check above is vacuous"


def test_unset_keys_keep_the_targets_value_not_the_default(tmp_path):
    user = write(tmp_path, "[train]\nsteps = 3\n")
    layered = settings.load("cpu", "native", PATHS, user)
    assert layered.lr == target_values("cpu")["lr"] != settings.TrainSettings().lr
    assert layered.constraint_policy == "fallback" != settings.TrainSettings().constraint_policy


def test_layers_in_order(tmp_path):
    """target [train] < target [paths.p] < user [train] < user [paths.p] < flags."""
    assert "compile" in tomllib.loads((settings.CONFIG_DIR / "trn2.toml").read_text())["paths"]["hf"]
    assert settings.load("trn2", "hf", PATHS).compile is False  # trn2.toml [paths.hf]
    user = write(tmp_path, "[train]\nsteps = 4\nlocal_batch_size = 3\n[paths.hf]\nsteps = 5\n")
    native, hf = settings.load("trn2", "native", PATHS, user), settings.load("trn2", "hf", PATHS, user)
    assert (native.steps, hf.steps) == (4, 5) and native.local_batch_size == hf.local_batch_size == 3
    assert hf.compile is False and hf.tensor_parallel == 4  # the target's keys the user left alone
    flagged = settings.with_flags(hf, steps=9, seq_len=None)
    assert flagged.steps == 9 and flagged.seq_len == hf.seq_len


def test_empty_user_file_changes_nothing(tmp_path):
    assert settings.load("cpu", "hf", PATHS, write(tmp_path, "")) == settings.load("cpu", "hf", PATHS)


def test_user_typo_is_refused_naming_file_and_key(tmp_path):
    user = write(tmp_path, "[train]\nstesp = 3\n")
    with pytest.raises(PipelineError) as err:
        settings.load("cpu", "native", PATHS, user)
    assert str(user) in err.value.problem and "'stesp' (did you mean steps?)" in err.value.problem


def test_every_target_file_sets_only_known_keys():
    known = {f.name for f in fields(settings.TrainSettings)}
    for target in settings.list_targets():
        assert set(target_values(target)) <= known, target


def test_the_train_stage_layers_config_over_the_target(tmp_path):
    """End to end through `train --dry-run --config`: run.json holds the layered settings."""
    user = write(tmp_path, "[train]\nsteps = 3\n")
    result = ok(cli("train", "--model", "tiny", "--path", "native", "--target", "cpu", "--dry-run",
                             "--config", str(user), "--seq-len", "64", root=tmp_path / "checkpoints"))
    spec = dry_run_spec(result.stdout)["settings"]
    cpu = target_values("cpu")
    assert spec["steps"] == 3 and spec["seq_len"] == 64
    assert spec["lr"] == cpu["lr"] and spec["nproc_per_node"] == cpu["nproc_per_node"]
    assert spec["constraint_policy"] == cpu["constraint_policy"]
