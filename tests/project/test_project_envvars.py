"""Every PIPELINE_* name anywhere in the repository (code, tests, Makefile, Dockerfile, workflows, docs)
is declared in pipeline/envvars.py: a variable read under a name nobody declared is one nobody can
find, document or rename."""

from __future__ import annotations

import re
import subprocess

from helpers import REPO
from pipeline import envvars

NAME = re.compile(r"\bPIPELINE_[A-Z0-9_]*[A-Z0-9]\b")


def declared() -> set[str]:
    return {v for k, v in vars(envvars).items() if k.isupper() and isinstance(v, str) and v.startswith("PIPELINE_")}


def tracked_files() -> list:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    return [REPO / name for name in listed if name and (REPO / name).is_file()]


# A Make variable the Makefile assigns (`PIPELINE_<NAME> := …`) and does not export is Make's own, no environment
# variable, when nothing outside the Makefile names it.
MAKE_ASSIGNED = re.compile(r"^(PIPELINE_[A-Z0-9_]+)\s*[:?+]?=", re.M)


def names_used() -> dict[str, str]:
    """PIPELINE_* name → the first file:line that spells it (Make's own variables aside)."""
    used: dict[str, str] = {}
    outside_makefile: set[str] = set()
    make_own: set[str] = set()
    for path in tracked_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if path == REPO / "Makefile":
            make_own = set(MAKE_ASSIGNED.findall(text))
        for n, line in enumerate(text.splitlines(), 1):
            for name in NAME.findall(line):
                used.setdefault(name, f"{path.relative_to(REPO)}:{n}")
                if path != REPO / "Makefile":
                    outside_makefile.add(name)
    return {name: where for name, where in used.items() if name not in make_own - outside_makefile}


def test_every_pipeline_variable_is_declared_in_envvars():
    used = names_used()
    assert {"PIPELINE_CHECKPOINTS", "PIPELINE_TEST_CHECKPOINTS", "PIPELINE_COMPILE_CACHE"} <= set(used)  # it reads
    undeclared = {name: where for name, where in used.items() if name not in declared()}
    assert not undeclared, f"declare these in pipeline/envvars.py: {undeclared}"


def test_the_scan_sees_an_undeclared_name():
    new = "PIPELINE_" + "NEW_KNOB"  # spelled in two halves, or the scan above would find it here
    assert NAME.findall(f'os.environ.get("{new}")') == [new] and new not in declared()
    assert NAME.findall("every PIPELINE_* name") == []


def test_a_make_variable_of_the_makefile_alone_is_makes_own(tmp_path, monkeypatch):
    """`PIPELINE_<NAME> = …` in the Makefile, named nowhere else, is a Make variable; named in Python too, it
    is read from the environment and must be declared."""
    own, read = "PIPELINE_" + "ONLY_MAKE", "PIPELINE_" + "ALSO_READ"
    (tmp_path / "Makefile").write_text(f"{own} = x\n{read} := y\nall: ; echo $({own}) $({read})\n")
    (tmp_path / "a.py").write_text(f'os.environ["{read}"]\n')
    monkeypatch.setattr("test_project_envvars.REPO", tmp_path)
    monkeypatch.setattr("test_project_envvars.tracked_files", lambda: [tmp_path / "Makefile", tmp_path / "a.py"])
    assert set(names_used()) == {read}
