"""bench/ reaches into the pipeline (bench/run.py, inproc.py, cuda_check.sh's inline Python): every
`from pipeline… import name` there must still name something, or `make bench` dies halfway (it did,
after host_need moved to training/memory.py). Where such a name is a module bound to one alias in
the file, the `alias.function(` calls on it are checked too."""

import importlib
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
FROM_IMPORT = re.compile(r"from (pipeline(?:\.\w+)*) import ([\w, ]+?)(?: as (\w+))?(?=;|\n|$|\))", re.M)
FILES = sorted(p for p in BENCH.iterdir() if p.suffix in (".py", ".sh"))


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


def missing_names(text: str) -> tuple[int, list[str]]:
    """(names checked, names that no longer exist)."""
    checked, missing, aliases = 0, [], {}
    for module, names, alias in FROM_IMPORT.findall(text):
        for name in (n.strip() for n in names.split(",")):
            checked += 1
            if not hasattr(importlib.import_module(module), name) and _module(f"{module}.{name}") is None:
                missing.append(f"{module}.{name}")
            elif _module(f"{module}.{name}") is not None:
                aliases.setdefault(alias or name, set()).add(f"{module}.{name}")
    for alias, modules in aliases.items():
        if len(modules) == 1:  # one binding: its calls can only mean that module
            (module,) = modules
            for attr in set(re.findall(rf"(?<![\w.]){re.escape(alias)}\.(\w+)\(", text)):
                checked += 1
                if not hasattr(importlib.import_module(module), attr):
                    missing.append(f"{module}.{attr}")
    return checked, missing


def test_bench_has_pipeline_imports_to_check():
    assert sum(missing_names(p.read_text())[0] for p in FILES) >= 20


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_pipeline_name_bench_uses_exists(path):
    _, missing = missing_names(path.read_text())
    assert not missing, f"{path.name} uses names the pipeline no longer has: {missing}"


def test_a_moved_name_is_caught():
    checked, missing = missing_names("from pipeline.stages.train import host_need\n"
                                     "from pipeline.data import dataset as d; d.register(d.nowhere('x'))\n")
    assert checked == 4 and missing == ["pipeline.stages.train.host_need", "pipeline.data.dataset.nowhere"]
