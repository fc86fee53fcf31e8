"""The nki path's preparation (models.registry calls it while a run is resolved).

Runs in the launching process, for dry runs too: picks the overrides the config names, checks
each kernel's documented constraints for the kernel that will actually run (NKI on trn2, the
PyTorch reference elsewhere, which has none), applies the constraint policy (error, or fallback
to the reference with a warning), and matches every override against the model's module names.
"""

from __future__ import annotations

import sys

from pipeline.errors import PipelineError
from pipeline.models.nki import constraints
from pipeline.models.nki.declarations import GROUPS
from pipeline.run.spec import RunSpec

NKI_TARGETS = ("trn2",)  # where the device is `neuron` and the NKI kernels are what runs


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def select(names: list[str]):
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise PipelineError(f"nki_overrides lists unknown {unknown}; known: {sorted(GROUPS)}.",
                            "fix nki_overrides in the config's [paths.nki] or [train] table.")
    return [o for n in names for o in GROUPS[n]]


def prepare(spec: RunSpec) -> None:
    settings = spec.settings
    chosen = select(list(settings.nki_overrides))
    backend = "nki" if spec.target in NKI_TARGETS else "reference"
    dims = constraints.dims_for(spec.arch.to_dict(), settings.seq_len, settings.local_batch_size, settings.lnc,
                                settings.tensor_parallel)
    entries, plan = [], {}
    for ov in chosen:
        problems = constraints.violations(ov.kernel, dims) if backend == "nki" else []
        use_nki = backend == "nki" and not problems
        if problems and settings.constraint_policy == "error":
            raise PipelineError(f"{'; '.join(problems)} (target {spec.target}, LNC={settings.lnc}, override {ov.function}).",
                                "change SEQ_LEN/model/parallelism to fit, or set constraint_policy = \"fallback\".")
        for problem in problems:
            _warn(f"{problem}: {ov.function} falls back to the PyTorch reference.")
        entries.append([ov.target, {"use_nki": use_nki}])
        plan[ov.function] = {"kernel": ov.kernel, "replaces": ov.replaces, "fqns": list(ov.fqns),
                             "runs": ov.kernel if use_nki else "reference", "violations": problems}
    spec.overrides = list(spec.overrides) + entries
    report = match(spec)
    for warning in report.warnings:
        _warn(warning)
    print(report.summary(), flush=True)
    spec.nki = {"backend": backend, "lnc": settings.lnc, "policy": settings.constraint_policy, "overrides": plan,
                "matched": {m.name: len(m.fqns) for m in report.matches}, "summary": report.summary()}


def match(spec: RunSpec):
    from pipeline.models import attention_backends, native, override_check

    backend = attention_backends.titan_backend(spec.settings.attention_backend)
    return override_check.check(spec.overrides, native.model_config(spec.arch, backend))
