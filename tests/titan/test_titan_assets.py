"""pipeline/titan/assets.py and the `tokenizer` setting: torchtitan's test tokenizer (AWS's
smoke run, a condition of configs/models.toml's 6.54), found in the working directory or in the
installed torchtitan's source checkout, and the tokenizer the trainer builds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.checkpoint import embedded
from pipeline.errors import PipelineError
from pipeline.titan import assets


def _assets(root: Path) -> Path:
    tokenizer = root / "tests" / "assets" / "tokenizer"
    tokenizer.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded.tokenizer_dir() / name, tokenizer / name)
    (root / "tests" / "assets" / "c4_test").mkdir()
    return tokenizer


def test_the_test_tokenizer_outside_a_checkout_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(assets, "checkout_root", lambda: None)
    with pytest.raises(PipelineError) as err:
        assets.tokenizer_dir("titan-test", "/source")
    assert "tests/assets/tokenizer" in err.value.problem and "\n" not in err.value.problem
    assert assets.tokenizer_dir("model", "/source") == "/source"


def test_assets_are_found_in_the_installed_torchtitans_checkout(tmp_path, monkeypatch):
    """An editable install (AWS's torchtitan-neuron) has them beside the package, whatever the cwd."""
    checkout = tmp_path / "torchtitan-neuron"
    tokenizer = _assets(checkout)
    (checkout / "torchtitan").mkdir()
    (checkout / "torchtitan" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(checkout))
    monkeypatch.delitem(__import__("sys").modules, "torchtitan", raising=False)
    assert assets.checkout_root() == checkout.resolve()
    assert assets.tokenizer_dir("titan-test", "/source") == str(tokenizer.resolve())


def test_the_trainer_builds_the_settings_tokenizer(tmp_path, monkeypatch):
    from pipeline.run.settings import TrainSettings
    from pipeline.training.entry import _tokenizer

    tokenizer = _assets(tmp_path)
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({"marker": "test tokenizer"}))
    monkeypatch.chdir(tmp_path)

    class Spec:
        source_dir = str(embedded.tokenizer_dir())
        settings = TrainSettings(tokenizer="titan-test")

    built = _tokenizer(Spec).build(tokenizer_path=Spec.source_dir)  # as torchtitan's Trainer calls it
    assert built.tokenizer_path == str(tokenizer.resolve())
    Spec.settings = TrainSettings()
    assert _tokenizer(Spec).build(tokenizer_path=Spec.source_dir).tokenizer_path == Spec.source_dir


def test_the_tokenizer_setting_takes_only_known_values(tmp_path):
    from pipeline.run import settings

    config = tmp_path / "c.toml"
    config.write_text('[train]\ntokenizer = "gpt2"\n')
    with pytest.raises(PipelineError, match="tokenizer = 'gpt2' is not allowed; allowed: model, titan-test"):
        settings.load("cpu", "native", ("hf", "native", "nki"), config)
