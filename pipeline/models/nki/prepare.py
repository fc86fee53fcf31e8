"""The nki path's preparation (models.registry calls it while a run is resolved).

Runs in the launching process, for dry runs too: picks the overrides the config names, drops
those the model cannot take (MoE overrides on a dense model), checks each kernel's documented
constraints for the kernel that will actually run (NKI on trn2, the PyTorch reference elsewhere,
which has none), applies the constraint policy per override (`error` refuses the run in one line,
`fallback` sends that override to its reference and says so once, here). Prints which overrides
attach and which were skipped, and why. All without torch: matching every attached override
against the model's module names needs torchtitan, so each rank does it before building
(pipeline.training.entry), and a dry run, which starts no rank, does it here in a child process
(pipeline.models.override_check).
"""

from __future__ import annotations

import sys

from pipeline.errors import PipelineError
from pipeline.models.nki import constraints
from pipeline.models.nki.declarations import GROUPS, NkiOverride
from pipeline.run.spec import RunSpec

NKI_TARGETS = ("trn2",)  # where the device is `neuron` and the NKI kernels are what runs


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def select(names: list[str]) -> list[NkiOverride]:
    unknown = [n for n in names if n not in GROUPS]
    if unknown:
        raise PipelineError(f"nki_overrides lists unknown {unknown}; known: {sorted(GROUPS)}.",
                            "fix nki_overrides in the config's [paths.nki] or [train] table.")
    return [o for n in names for o in GROUPS[n]]


def plan(spec: RunSpec) -> tuple[list[tuple[NkiOverride, bool, list[str]]], dict[str, str]]:
    """(override, use_nki, constraint violations) for each override that attaches, and
    {override: reason} for each one skipped. Raises under constraint_policy = "error"."""
    settings, arch = spec.settings, spec.arch.to_dict()
    nki_here = spec.target in NKI_TARGETS
    dims = constraints.dims_for(arch, settings.seq_len, settings.local_batch_size, settings.lnc,
                                settings.tensor_parallel)
    attached, skipped = [], {}
    for ov in select(list(settings.nki_overrides)):
        reason = ov.skip_reason(arch)
        if reason is not None:
            skipped[ov.function] = reason
            continue
        problems = constraints.violations(ov.kernel, dims) if nki_here else []
        if problems and settings.constraint_policy == "error":
            raise PipelineError(f"{'; '.join(problems)} (target {spec.target}, LNC={settings.lnc}, override "
                                f"{ov.function}).",
                                "change SEQ_LEN/model/parallelism to fit, or set constraint_policy = \"fallback\" "
                                "to run this override's PyTorch reference instead.")
        attached.append((ov, nki_here and not problems, problems))
    return attached, skipped


def prepare(spec: RunSpec, dry_run: bool = False) -> None:
    settings = spec.settings
    attached, skipped = plan(spec)
    for ov, _, problems in attached:
        if problems:  # fallback policy: once per override, at start-up
            _warn(f"{ov.function} runs its PyTorch reference instead of {ov.kernel}: {'; '.join(problems)}.")
    spec.overrides = list(spec.overrides) + [[ov.target, {"use_nki": use_nki}] for ov, use_nki, _ in attached]
    report = match_in_child(spec) if dry_run else None
    for warning in report.warnings if report else ():
        _warn(warning)
    runs = {ov.function: (ov.kernel if use_nki else "reference") for ov, use_nki, _ in attached}
    lines = ["nki overrides attached: " + (", ".join(f"{name} ({kernel})" for name, kernel in runs.items()) or "none")]
    lines += [f"nki override skipped: {name}: {reason}" for name, reason in skipped.items()]
    print("\n".join(lines + ([report.summary()] if report else [])), flush=True)
    spec.nki = {
        "backend": "nki" if spec.target in NKI_TARGETS else "reference", "lnc": settings.lnc,
        "policy": settings.constraint_policy,
        "overrides": {ov.function: {"kernel": ov.kernel, "replaces": ov.replaces, "fqns": list(ov.fqns),
                                    "runs": runs[ov.function], "violations": problems}
                      for ov, _, problems in attached},
        "skipped": skipped,
    }
    if report:
        spec.nki |= {"matched": {m.name: len(m.fqns) for m in report.matches}, "summary": report.summary()}


def match_in_child(spec: RunSpec):
    from pipeline.models import override_check

    return override_check.check_in_child(spec)
