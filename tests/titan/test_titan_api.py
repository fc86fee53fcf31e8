"""pipeline/titan/api.py: which torchtitan API is installed is read from what the package declares,
never from its version, and doctor names it (issue 17, item 1)."""

from __future__ import annotations

from pathlib import Path

from pipeline.host import doctor
from pipeline.titan import api


def fake_torchtitan(site: Path, configs_text: str | None, neuron: bool = False) -> Path:
    package = site / "torchtitan"
    (package / "config").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if configs_text is not None:
        (package / "config" / "configs.py").write_text(configs_text)
    if neuron:
        (site / "torchtitan_neuron").mkdir()
        (site / "torchtitan_neuron" / "__init__.py").write_text("")
    return package


MAIN_TRAINING = "class TrainingConfig:\n    max_context_length: int = 2048\n"
V030_TRAINING = "class TrainingConfig:\n    local_batch_size: int = 8\n    seq_len: int = 2048\n"


def test_the_api_comes_from_the_config_fields_not_the_version(tmp_path):
    assert api.variant_at(fake_torchtitan(tmp_path / "a", MAIN_TRAINING)) == api.MAIN
    assert api.variant_at(fake_torchtitan(tmp_path / "b", V030_TRAINING)) == api.V030
    assert api.variant_at(fake_torchtitan(tmp_path / "c", None)) == api.UNKNOWN


def test_the_installed_api_is_what_the_imported_config_class_says():
    assert api.variant() == api.variant_of_imported()


def test_doctor_names_the_api_and_torchtitan_neuron(tmp_path):
    site = tmp_path / "venv" / "lib" / "python3.14" / "site-packages"
    fake_torchtitan(site, MAIN_TRAINING, neuron=True)
    row = doctor.check_torchtitan_api(doctor.Environment("fake", (str(site),)))
    assert row.status == "ok" and "upstream torchtitan main API" in row.found
    assert f"torchtitan_neuron importable ({site / 'torchtitan_neuron'})" in row.found
    other = tmp_path / "other"
    fake_torchtitan(other, V030_TRAINING)
    row = doctor.check_torchtitan_api(doctor.Environment("fake", (str(other),)))
    assert "torchtitan 0.3.0 API" in row.found and "torchtitan_neuron not installed" in row.found
    missing = doctor.check_torchtitan_api(doctor.Environment("empty", (str(tmp_path / "none"),)))
    assert missing.status == "FAIL"


def test_training_config_carries_the_same_tokens_on_either_api():
    training = api.training_config(local_batch_size=3, seq_len=64, steps=1)
    tokens = getattr(training, api.batch_field()) * (1 if api.folded_batch() else 64)
    assert api.seq_len_of(training) == 64 and tokens == 3 * 64
