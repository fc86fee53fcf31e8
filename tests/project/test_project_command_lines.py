"""Command lines: no flag is ever an abbreviation of another. Every argparse parser in the repository is
made with allow_abbrev=False, and every stage's parser (`python -m pipeline <stage>`, enumerated from
pipeline.__main__.STAGES) refuses each of its flags shortened by one letter: `--name` must never be
taken as `--namespace` (issue 29: `make launch-eks RUN_NAME=sft` rendered namespace "sft")."""

from __future__ import annotations

import argparse
import ast
import json
import shlex
import shutil
import subprocess
import sys

import pytest
import yaml

from helpers import REPO, pipeline_env
from pipeline.__main__ import STAGES, stage_parser

SOURCES = sorted(p for folder in ("pipeline", "tests", "bench", "docker", ".ci") for p in (REPO / folder).rglob("*.py"))


def parser_calls() -> list[tuple[str, bool]]:
    """(file:line, has allow_abbrev=False) for every `ArgumentParser(…)` call in the repository."""
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "ArgumentParser":
                refuses = any(k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
                              for k in node.keywords)
                found.append((f"{path.relative_to(REPO)}:{node.lineno}", refuses))
    return found


def test_every_argparse_parser_refuses_abbreviations():
    calls = parser_calls()
    assert len(calls) >= 5, calls  # the reading finds the parsers (pipeline/__main__.py's, the tests')
    assert [where for where, refuses in calls if not refuses] == []


def _required_argv(parser: argparse.ArgumentParser) -> list[str]:
    argv = []
    for action in parser._actions:
        if action.required and action.option_strings:
            argv += [action.option_strings[0], str(action.choices[0]) if action.choices else "1"]
    return argv


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_stage_refuses_an_abbreviated_flag(stage, capsys):
    _, parser = stage_parser(stage)
    required = _required_argv(parser)
    options = [o for o in parser._option_string_actions if o.startswith("--")]
    # Each one a prefix of exactly one flag: argparse's default (allow_abbrev=True) would take it as that flag.
    shortened = [o[:-1] for o in options if o != "--help" and sum(p.startswith(o[:-1]) for p in options) == 1]
    assert len(shortened) >= len(options) // 2, f"{stage}: too few flags to check ({shortened})"
    for abbreviation in shortened:
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([*required, abbreviation, "1"])
        assert exit_.value.code == 2, abbreviation
        assert f"unrecognized arguments: {abbreviation}" in capsys.readouterr().err, (stage, abbreviation)


def test_launch_takes_name_as_the_run_never_as_the_namespace():
    from pipeline.stages import launch

    _, parser = stage_parser("launch")
    request = launch.request(parser.parse_args(["--scheduler", "eks", "--nodes", "2", "--model", "tiny",
                                                "--name", "sft"]))
    assert (request.run.name, request.run.path, request.namespace) == ("sft", "native", "default")
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduler", "eks", "--nodes", "2", "--model", "tiny", "--names", "sft"])


PUSHED = "registry.example:5000/qwen3-pipeline@sha256:" + "ab" * 32
HUB_MODEL = "Qwen/Qwen3-4B-Instruct-2507"  # dry-run resolvable from configs/hub_configs, no download


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
@pytest.mark.parametrize("scheduler", ["slurm", "eks"])
def test_run_name_reaches_the_launch_files_as_the_run(scheduler, tmp_path):
    """`make launch-<scheduler> RUN_NAME=sft`: the command Make prints, run as printed, renders the run
    runs/sft (run.json, the ConfigMap's copy) and leaves every other option at its default."""
    out = tmp_path / "files"
    shown = subprocess.run(["make", "--no-print-directory", "-n", f"launch-{scheduler}", "RUN_NAME=sft",
                            f"MODEL={HUB_MODEL}", f"IMAGE={PUSHED}", f"LAUNCH_DIR={out}"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout
    (line,) = [line for line in shown.splitlines() if " -m pipeline launch " in line]
    argv = shlex.split(line)
    argv[0] = sys.executable
    subprocess.run(argv, cwd=REPO, env=pipeline_env(tmp_path / "ckpt"), capture_output=True, text=True, check=True)
    if scheduler == "eks":
        documents = [d for d in yaml.safe_load_all((out / "job.yaml").read_text()) if d]
        assert {d["metadata"].get("namespace", "default") for d in documents} == {"default"}
        (config_map,) = [d for d in documents if d["kind"] == "ConfigMap"]
        spec = json.loads(config_map["data"]["run.json"])
    else:
        assert f"{out}/run.json" in (out / "train.sbatch").read_text()  # what the nodes' torchrun reads
        spec = json.loads((out / "run.json").read_text())
    assert spec["run_dir"].endswith("/Qwen--Qwen3-4B-Instruct-2507/runs/sft") and spec["path"] == "native"
