"""`python -m pipeline doctor --titan` (issue 27, item 1): one table of every torchtitan name, field and signature
the pipeline uses and whether the installed torchtitan has it, non-zero naming what is missing; what the trn2
workflow runs in the image first, so drift fails in seconds with the list."""

from __future__ import annotations

import ast
import subprocess
import sys
import types
from dataclasses import dataclass

import pytest

from helpers import REPO
from pipeline.errors import PipelineError
from pipeline.stages import doctor as doctor_stage
from pipeline.titan import api, internals


def test_doctor_titan_lists_every_name_and_passes_on_the_installed_torchtitan(tmp_path):
    # as the image runs it: its own interpreter, from the code's directory, nothing but the package and torchtitan
    result = subprocess.run([sys.executable, "-m", "pipeline", "doctor", "--titan", "--target", "trn2"], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"torchtitan {internals.torchtitan_version()}: {api.DESCRIPTION[api.variant()]}")
    names = internals.internals_for("trn2")
    body = [line for line in lines[3:] if line.strip()]
    assert len(body) == len(names)  # one row per name
    for name, line in zip(names, body):
        assert line.startswith(name.qualname) and line.rstrip().endswith(("ok", "-")), line
    spec_row = next(line for line in body if "ModelSpec (required fields)" in line)
    # the simulated "main after #4328" tier: the required max_context_length, which the pipeline supplies
    assert ("max_context_length" in spec_row) == ("+sim.pr4328" in internals.torchtitan_version())


def test_a_missing_name_field_or_keyword_fails_naming_each(monkeypatch, capsys):
    gone = (internals.TitanName("torchtitan.models.qwen3", "_no_such_builder", "test"),
            internals.TitanName("torchtitan.config", "TrainingConfig", "test", field="no_such_field"),
            internals.TitanName("torchtitan.config", "override", "test", parameter="no_such_keyword"))
    everything = internals.internals_for("trn2")
    monkeypatch.setattr(internals, "internals_for", lambda target: everything + gone)
    with pytest.raises(PipelineError) as err:
        doctor_stage.titan("trn2")
    text = str(err.value)
    for name in gone:
        assert name.qualname in text
    assert "lacks 3 of the names" in text and "\n" not in text
    rows = capsys.readouterr().out
    assert "MISSING (no such field)" in rows and "MISSING (no such keyword)" in rows and "MISSING (absent)" in rows


@dataclass
class _SpecRequiringMore:
    name: str
    tokenizer_fn: object


def test_a_model_spec_requiring_a_field_the_pipeline_cannot_supply_fails(monkeypatch):
    fake = types.ModuleType("fake_titan_spec")
    fake.ModelSpec = _SpecRequiringMore
    monkeypatch.setitem(sys.modules, "fake_titan_spec", fake)
    row = internals.RequiredFields("fake_titan_spec", "ModelSpec", "test")
    assert row.missing() == "requires tokenizer_fn, which the pipeline does not supply"
    gone = internals.RequiredFields("fake_titan_spec_gone", "ModelSpec", "test")
    assert gone.missing() is None and "after #4810" in gone.found()  # covered by Trainer.Config.model


def test_one_of_takes_either_place():
    moved = internals.OneOf((internals.TitanName("torchtitan.config", "TrainingConfig", "", field="no_such_field"),
                             internals.TitanName("torchtitan.config", "TrainingConfig", "", field="steps")), "test")
    assert moved.missing() is None and moved.found().endswith("TrainingConfig.steps")
    neither = internals.OneOf(moved.options[:1], "test")
    assert neither.missing() == "none of them"


def test_names_of_another_api_are_not_required():
    other = api.MAIN if api.variant() == api.V030 else api.V030
    foreign = internals.TitanName("torchtitan.config", "TrainingConfig", "test", field="no_such_field", apis=(other,))
    assert internals.missing_internals((foreign,)) == []
    assert internals.missing_internals((foreign,), variant=other) == ["torchtitan.config.TrainingConfig.no_such_field"]


def _imported_names() -> set[tuple[str, str]]:
    found = set()
    for path in (REPO / "pipeline").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchtitan"):
                found |= {(node.module, alias.name) for alias in node.names}
    return found


def test_every_torchtitan_import_of_the_pipeline_is_in_the_table():
    listed = {(option.module, option.name.split(".")[0])
              for name in internals.internals_for("cpu") + internals.internals_for("trn2")
              for option in getattr(name, "options", (name,))}
    assert sorted(_imported_names() - listed) == []


def test_a_module_failing_on_another_import_says_which(tmp_path, monkeypatch):
    """torchtitan.trainer imports triton at the top: an image without it should read so, not 'absent'."""
    (tmp_path / "fake_titan_trainer.py").write_text("import no_such_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    name = internals.TitanName("fake_titan_trainer", "Trainer", "test")
    assert name.missing() == "import failed: No module named 'no_such_module_xyz'"
    assert internals.TitanName("fake_titan_absent", "Trainer", "test").missing() == "absent"
