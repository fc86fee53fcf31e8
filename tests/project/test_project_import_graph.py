"""The module graph: every pipeline module imports on its own in a fresh interpreter; the graph of
pipeline-internal imports (module level, inside functions, importlib.import_module of a constant) has
no cycle; a module imports only from its own package and the packages its package is declared to build
on (DEPENDS, directly or through them); and a stage imports no other stage: each is a thin command line
over the packages below it."""

from __future__ import annotations

import ast
import concurrent.futures
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pipeline"
CORE = ("errors", "fsutil", "dtypes", "envvars", "flags", "console", "malloc")  # pipeline/*.py: the "core" package
# Each package → the packages it builds on directly; it may import those and, through them, what they build
# on. A graph, not a line: data and models both build on titan and know nothing of each other, and outputs
# reads runs back without the data, training or launch code that made them.
DEPENDS = {
    "core": (),
    "checkpoint": ("core",),  # HF checkpoint directories, the embedded models and their corpus
    "run": ("checkpoint",),  # records with no torch: settings, targets, run.json, run directories, the store
    "titan": ("run",),  # torchtitan glue
    "models": ("titan",),  # the training paths' models
    "data": ("titan",),  # what a run trains on (torchtitan's dataset registry, its tokenizer)
    "training": ("models", "data"),  # a run resolved (launcher side) and trained (rank side)
    "launch": ("training",),  # torchrun, the launcher, cluster files, the image, the download
    "outputs": ("models",),  # export, verify, report, the model card
    "host": ("launch", "outputs"),  # doctor, image builds, pins, push; the Make interface (every stage's request)
    "stages": ("host", "outputs"),
    "cli": ("stages",),  # pipeline/__main__.py
}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = modules()


def _owner(name: str) -> str | None:
    """The module a dotted name lives in: itself, or the nearest enclosing module (pkg.mod.attr → pkg.mod)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> dict[str, int]:
    """Pipeline modules `module` imports → the line of the first such import, from its AST: `import`,
    `from … import` (relative too) anywhere in the file, and importlib.import_module("pipeline.…").
    (A module named in a string that torchtitan imports later, such as an override.imports entry, is
    not an import of the module holding the string.)"""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(name: str | None, node: ast.AST) -> None:
        if name and name != module:
            found.setdefault(name, node.lineno)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "pipeline":
                    add(_owner(alias.name), node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "pipeline":
                continue
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                add(submodule if submodule in MODULES else _owner(source), node)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("pipeline")):
            add(_owner(node.args[0].value), node)
    return found


GRAPH = {module: imports_of(module) for module in MODULES}


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle as [a, b, …, a], or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def package(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in CORE:
        return "core"
    return "cli" if parts[1] == "__main__" else parts[1]


def reachable(depends: dict[str, tuple[str, ...]], start: str) -> set[str]:
    """The packages `start` builds on, directly or through others (itself excluded unless a cycle leads back)."""
    found: set[str] = set()
    todo = list(depends[start])
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo.extend(depends[name])
    return found


ALLOWED = {name: reachable(DEPENDS, name) for name in DEPENDS}


def test_the_graph_sees_the_imports_it_must():
    """The AST reading is not vacuous: known edges of each kind are found."""
    assert "pipeline.errors" in GRAPH["pipeline.run.settings"]  # module level, `from pipeline.errors import …`
    assert "pipeline.training.titan_flags" in GRAPH["pipeline.training.resolve"]  # inside a function
    assert "pipeline.models.nki.prepare" in GRAPH["pipeline.models.registry"]  # `from pipeline.models.nki import prepare`
    assert len(MODULES) > 40 and sum(map(len, GRAPH.values())) > 100


def test_find_cycle_reports_one():
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    if cycle:
        lines = [f"{a} imports {b} ({MODULES[a].relative_to(REPO)}:{GRAPH[a][b]})" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("import cycle:\n  " + "\n  ".join(lines))


def test_every_package_is_declared():
    """A new package (a new room) states what it builds on before anything may import it."""
    packages = {package(m) for m in MODULES}
    assert packages == set(DEPENDS), f"declare in DEPENDS: {sorted(packages - set(DEPENDS))}; " \
                                     f"gone: {sorted(set(DEPENDS) - packages)}"


def test_the_declared_graph_has_no_cycle():
    assert not [name for name in DEPENDS if name in ALLOWED[name]]
    assert all(target in DEPENDS for targets in DEPENDS.values() for target in targets)


def test_the_declared_graph_keeps_the_rooms_apart():
    """The graph is not vacuous: the rooms that must not see each other do not."""
    assert {"launch", "training", "stages", "models"}.isdisjoint(ALLOWED["data"])
    assert {"data", "training", "launch"}.isdisjoint(ALLOWED["outputs"])
    assert "data" not in ALLOWED["models"] and "launch" not in ALLOWED["training"]
    assert ALLOWED["stages"] == set(DEPENDS) - {"stages", "cli"}


def test_no_module_imports_outside_what_its_package_builds_on():
    outside = [f"{m} ({package(m)}) imports {t} ({package(t)}) at {MODULES[m].relative_to(REPO)}:{line}"
               for m, targets in sorted(GRAPH.items()) for t, line in sorted(targets.items())
               if package(t) != package(m) and package(t) not in ALLOWED[package(m)]]
    assert not outside, "\n".join(outside)


def test_no_stage_imports_another_stage():
    stages = [m for m in MODULES if m.startswith("pipeline.stages.")]
    assert len(stages) >= 10
    crossing = [f"{m} imports {t} at {MODULES[m].relative_to(REPO)}:{line}" for m in stages
                for t, line in sorted(GRAPH[m].items()) if t.startswith("pipeline.stages.")]
    assert not crossing, "\n".join(crossing)


def test_the_stages_stay_thin():
    """The stages are command lines over the packages: their operations live with their domain."""
    lines = {m: len(MODULES[m].read_text().splitlines()) for m in MODULES if m.startswith("pipeline.stages.")}
    assert sum(lines.values()) <= 1300, lines
    assert max(lines.values()) <= 150, lines


# Kernel entry points that import nki/nkilib at module level: importable only in the Neuron image. Here
# they must fail for exactly that reason (and nothing else may import them at module level).
NEURON_ONLY = {"pipeline.models.nki.neuron_kernels.rope": "No module named 'nkilib'",
               "pipeline.models.nki.neuron_kernels.router": "No module named 'nki'",
               "pipeline.models.nki.neuron_kernels.moe": "No module named 'nki'"}


@pytest.mark.slow  # one interpreter per module: ~60 s one after another, ~35 s two at a time on 2 cores
def test_every_module_imports_in_a_fresh_interpreter():
    """Each module alone, in its own interpreter: no module works only when something else was imported first."""

    def imported(module: str) -> tuple[str, subprocess.CompletedProcess]:
        return module, subprocess.run([sys.executable, "-c", f"import {module}"], cwd=REPO, capture_output=True,
                                      text=True, timeout=300)

    failures = []
    # Two at a time: an interpreter spends part of its start reading files, so the cores stay busy.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for module, result in pool.map(imported, MODULES):
            last = (result.stderr.strip().splitlines() or ["?"])[-1]
            if module in NEURON_ONLY:
                if result.returncode == 0 or NEURON_ONLY[module] not in last:
                    failures.append(f"{module}: expected to fail on {NEURON_ONLY[module]!r} here, got: {last}")
            elif result.returncode != 0:
                failures.append(f"{module}: {last}")
    assert not failures, "\n".join(failures)
