"""Startup check of torchtitan `override.imports` against a model's config tree.

torchtitan 0.3.0 applies overrides inside Trainer.__init__ and only warns when *no* override
matched at all. The pipeline wants more, before any build or compile: every override matched
with the same rules torchtitan uses (target class, `exact`, fnmatch FQN globs from the
Trainer.Config root, no descent below a match), a warning per override that matched nothing
listing the closest real module names, conflicts (same node, or ancestor/descendant) stopping
the run naming both, and a one-line summary.

It needs torchtitan, so it runs where torchtitan is imported anyway: in every rank before the
trainer is built (pipeline.training.entry). A dry run, which starts no rank, runs it in a child
process (`python -m pipeline.models.override_check`, run.json on stdin, the report as JSON on
stdout), so the launching process never imports torch or torchtitan.
"""

from __future__ import annotations

import difflib
import importlib
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from pipeline.errors import PipelineError
from pipeline.titan import accessors, model_spec


@dataclass
class OverrideMatch:
    name: str
    target: str
    patterns: list[str] | None
    fqns: list[str] = field(default_factory=list)


@dataclass
class CheckReport:
    matches: list[OverrideMatch]
    warnings: list[str]

    def summary(self) -> str:
        parts = [f"{m.name.rsplit('.', 1)[-1]} → {len(m.fqns)}× {m.target}" for m in self.matches]
        return "overrides: " + ("; ".join(parts) if parts else "none")

    def count(self, name: str) -> int:
        return next(len(m.fqns) for m in self.matches if m.name == name or m.name.endswith("." + name))


def _entry_name(entry) -> str:
    return entry if isinstance(entry, str) else entry[0]


def registered(name: str):
    """The torchtitan Override object a `module.function` target names (imports its module)."""
    module, _, _ = name.rpartition(".")
    try:
        importlib.import_module(module)
    except ImportError as err:
        raise PipelineError(f"override {name!r}: module {module!r} cannot be imported ({err}).",
                            "fix the override.imports entry.") from err
    found = accessors.registered_override(name)
    if found is None:
        raise PipelineError(f"override {name!r} names no registered @override.", "fix the override.imports entry.")
    return found


def all_module_fqns(model_config) -> list[str]:
    from torchtitan.config.configurable import Configurable

    return [fqn for fqn, *_ in accessors.traverse(model_config, Configurable.Config, model_spec.fqn_root(), recurse=True)]


def check(imports: list, model_config) -> CheckReport:
    names = [_entry_name(e) for e in imports]
    everything = all_module_fqns(model_config)
    root = model_spec.fqn_root()  # where Trainer.Config holds the model config
    matches, warnings = [], []
    for name in names:
        ov = registered(name)
        found = [fqn for fqn, cfg, _, _ in accessors.traverse(model_config, ov.target_cls, root)
                 if (not ov.exact or type(cfg) is ov.target_cls) and ov.matches(fqn)]
        matches.append(OverrideMatch(name, ov.target_cls.__qualname__.removesuffix(".Config"), ov.fqns, found))
        if not found:
            warnings.append(f"override {name} matched nothing (target {ov.target_cls.__qualname__}, fqns "
                            f"{ov.fqns or 'all'}); closest module names: {', '.join(_closest(ov.fqns, everything))}")
    _check_conflicts(matches)
    return CheckReport(matches, warnings)


def _closest(patterns: list[str] | None, names: list[str]) -> list[str]:
    probes = [p.replace("*", "") for p in (patterns or [""])]
    scored = sorted(names, key=lambda n: -max(difflib.SequenceMatcher(None, p, n).ratio() for p in probes))
    return scored[:3] or ["(model has no modules)"]


def _check_conflicts(matches: list[OverrideMatch]) -> None:
    owner: dict[str, str] = {}
    for m in matches:
        for fqn in m.fqns:
            if fqn in owner and owner[fqn] != m.name:
                raise PipelineError(f"overrides {owner[fqn]} and {m.name} both claim {fqn}.",
                                    "narrow their fqns patterns or drop one of them.")
            owner[fqn] = m.name
    for a, a_owner in owner.items():
        for b, b_owner in owner.items():
            if a_owner != b_owner and b.startswith(a + "."):
                raise PipelineError(f"override {a_owner} claims {a}, an ancestor of {b} claimed by {b_owner}.",
                                    "nested replacements are order-dependent: narrow one pattern.")


def check_spec(spec) -> CheckReport:
    """A run's override.imports against its model (the native Qwen3 tree every override targets)."""
    from pipeline.models import attention_backends, native

    backend = attention_backends.titan_backend(spec.settings.attention_backend)
    return check(spec.overrides, native.model_config(spec.arch, backend, max_context_length=spec.settings.seq_len))


def check_in_child(spec) -> CheckReport:
    """check_spec in a child process: the caller stays free of torch and torchtitan."""
    result = subprocess.run([sys.executable, "-m", __name__], input=spec.to_json(), capture_output=True,
                            text=True)
    try:
        answer = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise RuntimeError(f"override check failed (exit {result.returncode}):\n{result.stderr[-3000:]}") from None
    if "error" in answer:
        raise PipelineError(*answer["error"])
    return CheckReport([OverrideMatch(**m) for m in answer["matches"]], answer["warnings"])


def _main() -> None:
    from pipeline.run.spec import RunSpec

    spec = RunSpec.from_dict(json.loads(sys.stdin.read()))
    try:
        report = check_spec(spec)
    except PipelineError as err:
        print(json.dumps({"error": [err.problem, err.fix]}))
        return
    print(json.dumps({"matches": [asdict(m) for m in report.matches], "warnings": report.warnings}))


if __name__ == "__main__":
    _main()
