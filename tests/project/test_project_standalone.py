"""The repository stands alone: no file in it (code, configs, docs, tests) points at files outside it, such
as the notes or wheels a development machine keeps beside the checkout, which a user's clone does not have.
Facts come with a public source instead (docs/sources.md). Exempt: CI's optional upstream-main wheel tier
(.ci/run) and the Makefile's default for its wheel (TITAN_MAIN_WHEEL ?=), which say where CI keeps it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from helpers import REPO

# The development machine's sibling folder (its name is assembled, so this file holds no such reference itself),
# its notes and wheels folders, the machine's work tree, or one of those notes by its file name.
SIBLING = "sha" + "red"
OUTSIDE = re.compile(rf"\.\./{SIBLING}\b|/wo" + rf"rk/|\b{SIBLING}/(notes|wheels)\b"
                     r"|\b(neuron|torchtitan-on-cpu|qwen3|reference-recipe|clients|docker-here)\.md\b")
EXEMPT_FILES = {".ci/run"}
EXEMPT_LINES = {"Makefile": re.compile(r"^TITAN_MAIN_WHEEL \?= ")}


def repository_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    return [REPO / name for name in listed if name and (REPO / name).is_file()]


def references(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        name = path.relative_to(REPO).as_posix()
        if name in EXEMPT_FILES:
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line) and not (name in EXEMPT_LINES and EXEMPT_LINES[name].search(line)):
                found.append(f"{name}:{n}: {line.strip()[:120]}")
    return found


def test_nothing_points_outside_the_repository():
    files = repository_files()
    assert len(files) > 150 and (REPO / "docs" / "sources.md") in files
    assert references(files) == [], "cite a public source (and write the fact into docs/sources.md) instead"


def test_the_scan_finds_each_kind_of_reference(tmp_path, monkeypatch):
    monkeypatch.setattr("test_project_standalone.REPO", tmp_path)
    lines = [f"see ../{SIBLING}/notes/x", "/wo" + "rk/main/y", f"({SIBLING}/wheels; z)", "(neuron" + ".md, w)",
             "docs/design.md is ours"]
    (tmp_path / "a.py").write_text("\n".join(lines) + "\n")
    (tmp_path / "Makefile").write_text(f"TITAN_MAIN_WHEEL ?= ../{SIBLING}/wheels/w.whl\n")
    assert [r.split(":")[1] for r in references([tmp_path / "a.py", tmp_path / "Makefile"])] == ["1", "2", "3", "4"]
