"""pipeline/run/settings.py: what is known about a setting lives on its field (its choices and minimum,
the Make variable, the torchtitan field it sets, whether a run continues under another value, whether
it is a condition of the expected step-1 loss, whether it is workload), checked in one place
(check_value); the modules that use a fact read it from there, and no module keeps a list of setting
names of its own."""

from __future__ import annotations

import ast

import pytest

from helpers import REPO
from pipeline.errors import PipelineError
from pipeline.run import continuation, expectation, settings
from pipeline.run.settings import TrainSettings


def test_each_use_reads_the_fields():
    from pipeline.training import rehearsal, titan_flags

    assert set(expectation.CONDITION_SETTINGS) == {"dataset", "tokenizer", "seq_len", "dtype"}
    assert set(rehearsal.WORKLOAD) == {"dataset", "seq_len", "local_batch_size", "seed", "steps",
                                       "checkpoint_interval", "keep_latest_k"}
    assert {k for k in continuation.NOT_COMPARED if k.startswith("settings.")} == {"settings.steps",
                                                                                  "settings.export_dtype"}
    folded = {f.setting: (f.field, f.how) for f in titan_flags.FOLDED}
    assert len(folded) == 13 and folded["steps"] == ("training.steps", "STEPS=")
    assert folded["seq_len"] == (titan_flags.CONTEXT, "SEQ_LEN=")
    assert folded["dtype"] == ("training.mixed_precision_param", "dtype in CONFIG")


@pytest.mark.parametrize("where", ["config", "flag"])
def test_choices_and_minimum_are_checked_in_every_layer(where, tmp_path):
    def apply(**values):
        if where == "flag":
            return settings.with_flags(TrainSettings(), **values)
        config = tmp_path / "mine.toml"
        config.write_text("[train]\n" + "".join(f"{k} = {v!r}\n".replace("'", '"') for k, v in values.items()))
        return settings.load("cpu", "native", ("native",), config)

    assert apply(steps=0).steps == 0 and apply(seq_len=64).seq_len == 64
    with pytest.raises(PipelineError, match="STEPS=-1 is negative"):
        apply(steps=-1)
    with pytest.raises(PipelineError, match="SEQ_LEN=0 must be at least 1"):
        apply(seq_len=0)
    with pytest.raises(PipelineError, match="local_batch_size = 0 must be at least 1"):
        apply(local_batch_size=0)
    with pytest.raises(PipelineError, match="compile_backend = 'tvm' is not allowed; allowed: inductor"):
        apply(compile_backend="tvm")


def test_a_new_fact_is_one_keyword_on_the_field():
    assert settings.facts("export_dtype")["make"] == "DTYPE" and settings.facts("nproc_per_node")["make"] == "NPROC"
    assert settings.named("continues") == ("steps", "export_dtype")
    assert "choices" not in settings.facts("lr") and settings.named("no such fact") == ()


def lists_of_names(text: str) -> list[tuple[int, list[str]]]:
    """(line, names) of each tuple, list or set literal of three or more TrainSettings field names."""
    names = {f.name for f in settings.fields(TrainSettings)}
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            strings = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(strings) >= 3 and len(strings) == len(node.elts) and set(strings) <= names:
                found.append((node.lineno, strings))
    return found


def test_no_module_keeps_its_own_list_of_setting_names():
    """Such a list outside settings.py is a list beside the fields: the fact belongs on them."""
    assert lists_of_names('WORKLOAD = ("dataset", "seq_len", "seed")\nOTHER = ("a", "seq_len", "seed")\n') == \
        [(1, ["dataset", "seq_len", "seed"])]
    found = [f"{path.relative_to(REPO)}:{line}: {names}" for path in sorted((REPO / "pipeline").rglob("*.py"))
             if path != REPO / "pipeline" / "run" / "settings.py" for line, names in lists_of_names(path.read_text())]
    assert found == []
