"""House habits the repository keeps: `make test` (and `make test-fast`) lint first with ruff under
pyproject.toml's rules, the pytest markers are declared in pyproject.toml, and nothing puts a path on
sys.path by hand (pyproject.toml's pytest `pythonpath` and `python -m` from the repository root do)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib

import pytest

from helpers import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


@pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")
@pytest.mark.parametrize("target", ["test", "test-fast"])
def test_the_test_targets_lint_before_pytest(target):
    shown = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    lint = next(i for i, line in enumerate(shown) if re.search(r"ruff'? check \.$", line))
    assert lint < next(i for i, line in enumerate(shown) if " -m pytest " in line)


def test_the_markers_and_the_path_are_pyprojects():
    options = PYPROJECT["tool"]["pytest"]["ini_options"]
    assert {m.split(":")[0] for m in options["markers"]} == {"slow", "titan", "titan_e2e"}
    assert "." in options["pythonpath"]
    assert "addinivalue_line" not in (REPO / "tests" / "conftest.py").read_text()


def test_nothing_inserts_into_sys_path():
    sources = sorted(p for folder in ("pipeline", "tests", "bench", "docker") for p in (REPO / folder).rglob("*.py"))
    assert len(sources) > 100
    spelled = "sys.path." + "insert"  # in two halves, or this file would spell it
    found = [f"{p.relative_to(REPO)}:{n}" for p in sources for n, line in enumerate(p.read_text().splitlines(), 1)
             if spelled in line]
    assert found == []


def test_a_missing_tool_is_a_failure_in_ci_and_a_skip_elsewhere(monkeypatch):
    from _pytest.outcomes import Failed, Skipped

    from helpers import missing_tool

    monkeypatch.setenv("CI", "1")
    with pytest.raises(Failed, match="CI must provide this: no venv"):
        missing_tool("no venv")
    monkeypatch.delenv("CI")
    with pytest.raises(Skipped, match="no venv"):
        missing_tool("no venv")
