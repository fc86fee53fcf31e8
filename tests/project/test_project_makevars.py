"""make/variables.mk, the Make interface generated from the dataclasses' fields (pipeline.host.makevars): the
committed file is what the fields give, every variable the Makefile reads from the user is in its table, and
the flags strings are flags the stages take."""

from __future__ import annotations

import re

import pytest

from helpers import REPO
from pipeline.__main__ import stage_parser
from pipeline.errors import PipelineError
from pipeline.host import makevars

MAKE_FILES = (REPO / "Makefile", makevars.OUTPUT)
NAME = r"[A-Z][A-Z0-9_]*"
# Make's own, and the one environment-only stand-in (tests set HAS_NEURON for the device).
NOT_USERS = {"MAKE", "MAKECMDGOALS", "MAKEFILE_LIST", "MAKEFLAGS", "MFLAGS", "HAS_NEURON"}


def test_the_committed_file_is_current(tmp_path):
    module, parser = stage_parser("makevars")
    assert makevars.OUTPUT.read_text() == makevars.render(), f"make/variables.mk is stale: run `{makevars.COMMAND}`"
    module.run(parser.parse_args(["--check"]))
    stale = tmp_path / "variables.mk"
    stale.write_text(makevars.render().replace("STEPS|", "STEP|"))
    with pytest.raises(PipelineError, match="not what the dataclasses' fields give"):
        module.run(parser.parse_args(["--check", "--output", str(stale)]))
    with pytest.raises(PipelineError, match="is a directory"):  # not an OSError traceback
        module.run(parser.parse_args(["--output", str(tmp_path)]))


def table(text: str) -> set[str]:
    block = re.search(r"^define VARIABLES\n(.*?)^endef", text, re.S | re.M).group(1)
    return {line.split("|")[0] for line in block.splitlines() if line.strip()}


def missing_from_table(text: str) -> set[str]:
    """Variables `text` (Makefile and include) reads that the user gives and its table lacks: read and not
    assigned globally (a target's own default, sft's RUN_NAME, is still the user's), or given a default `?=`."""
    read = set(re.findall(rf"\$\(({NAME})\)", text)) | set(re.findall(rf"\$\(call (?:on|q),\$?\(?({NAME})\)", text))
    read |= set(re.findall(rf"\$\(origin ({NAME})\)", text))
    assigned = set(re.findall(rf"^(?:export |override )?({NAME}) *(?::=|=)", text, re.M))
    assigned |= set(re.findall(rf"^define ({NAME})$", text, re.M))
    defaulted = set(re.findall(rf"^({NAME}) *\?=", text, re.M))
    external = set(re.search(r"^EXTERNAL_VARS := (.*)$", text, re.M).group(1).split())
    return ((read - assigned) | defaulted) - table(text) - external - NOT_USERS


def test_every_variable_make_reads_from_the_user_is_in_the_table():
    text = "\n".join(path.read_text() for path in MAKE_FILES)
    assert {"STEPS", "SEQ_LEN", "DTYPE", "RUN_NAME", "NODES", "VENV"} <= table(text)
    assert missing_from_table(text) == set(), "add them to a dataclass field's `make` (or makevars.MAKE_ONLY)"


def test_the_check_finds_a_variable_missing_from_the_table():
    text = "\n".join(path.read_text() for path in MAKE_FILES)
    assert missing_from_table(text + "\nnew:\n\techo $(call q,$(NEW_KNOB))\n") == {"NEW_KNOB"}
    assert missing_from_table(text + "\nOTHER_KNOB ?= 1\n") == {"OTHER_KNOB"}
    assert missing_from_table(text + "\nx:\n\t$(if $(call on,FLAG_KNOB),--flag)\n") == {"FLAG_KNOB"}
    assert missing_from_table(text.replace("\nSEQ_LEN|", "\nSEQ_LENGTH|")) == {"SEQ_LEN"}


# stage → the flags strings its Make targets pass it (the Makefile's recipes)
PASSED = {"train": ("RUN_FLAGS", "TRAIN_FLAGS"), "launch": ("RUN_FLAGS", "TRAIN_FLAGS", "LAUNCH_FLAGS"),
          "data": ("DATA_FLAGS",), "export": ("RUN_FLAGS", "EXPORT_FLAGS"), "verify": ("RUN_FLAGS", "VERIFY_FLAGS"),
          "eval": ("RUN_FLAGS", "EVAL_FLAGS"), "publish": ("RUN_FLAGS", "PUBLISH_FLAGS"), "report": ("REPORT_FLAGS",)}


@pytest.mark.parametrize("stage", sorted(PASSED))
def test_the_flags_strings_are_flags_of_the_stage(stage):
    makefile = (REPO / "Makefile").read_text()
    for string in PASSED[stage]:
        assert re.search(rf"\$\((HOST_)?PIPE\) {stage} .*\$\({string}\)", makefile), (stage, string)
    _, parser = stage_parser(stage)
    vars_ = makevars.make_vars()
    passed = {re.search(r"--[a-z-]+", v.flag).group(0) for s in PASSED[stage] for v in vars_[s]}
    assert {"--model", *(["--name"] if "RUN_FLAGS" in PASSED[stage] else ["--seq-len"] if "DATA_FLAGS" in PASSED[stage]
                         else [])} <= passed
    assert passed <= set(parser._option_string_actions), passed - set(parser._option_string_actions)


def test_a_variable_several_stages_take_has_one_row_from_the_first_string():
    """FORCE, DRY_RUN and ADAPTER are fields of several requests: one row each (the first string's meaning),
    and each string still passes its own stage's flag."""
    rows = [line for line in makevars.render().splitlines() if line.split("|")[0] in ("DRY_RUN", "FORCE", "ADAPTER")]
    assert [row.split("|")[0] for row in rows] == ["DRY_RUN", "FORCE", "ADAPTER"]
    assert "train: launch past the host-memory check" in rows[1] and "publish: 1 uploads those" in rows[2]
    flags_of = {s: " ".join(v.flag for v in found) for s, found in makevars.make_vars().items()}
    assert "$(call on,FORCE),--force" in flags_of["EXPORT_FLAGS"] and "--dry-run" in flags_of["PUBLISH_FLAGS"]
    assert "$(call on,ADAPTER),--adapter" in flags_of["EXPORT_FLAGS"] and "--adapter" in flags_of["PUBLISH_FLAGS"]
