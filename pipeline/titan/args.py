"""TITAN_ARGS: torchtitan's own CLI flags (`--training.steps 5`) applied over the Trainer.Config the
pipeline builds, parsed by the parser `torchtitan.train` uses; a bad flag is one line.

Which of the flags' changes the pipeline owns (folded into its settings or refused) is
`pipeline.training.titan_flags`' concern; this module only parses and applies them. It uses
torchtitan's public config API only.
"""

from __future__ import annotations

import shlex

from pipeline.errors import PipelineError


def apply_titan_args(config, args: list[str]):
    """torchtitan's own CLI flags (`--training.steps 5`) over a built Trainer.Config, parsed by the
    parser `torchtitan.train` uses (tyro with torchtitan's registry of custom rules). An unknown or
    ill-typed flag is a one-line PipelineError naming it (tyro's boxed report is kept out of sight)."""
    if not args:
        return config
    import contextlib
    import io

    import tyro
    from torchtitan.config.manager import ConfigManager, custom_registry

    ConfigManager()  # its __init__ registers torchtitan's rules (comma lists, override.imports) on the registry
    if "--help" in args or "-h" in args:  # TITAN_ARGS=--help: tyro prints every flag with its value here, exits 0
        tyro.cli(type(config), args=["--help"], default=config, registry=custom_registry, prog="TITAN_ARGS")

    def parse(strict: bool):
        report = io.StringIO()
        with contextlib.redirect_stdout(report), contextlib.redirect_stderr(report):
            try:
                return tyro.cli(type(config), args=list(args), default=config, registry=custom_registry,
                                prog="TITAN_ARGS", return_unknown_args=not strict), ""
            except SystemExit:
                return None, report.getvalue()

    parsed, report = parse(strict=False)
    if parsed is None:
        raise PipelineError(f"TITAN_ARGS {shlex.join(args)!r}: {_tyro_problem(report)}.", TITAN_ARGS_FIX)
    parsed, unknown = parsed
    if unknown:
        flags = [u for u in unknown if u.startswith("-")] or unknown
        hint = _tyro_suggestion(parse(strict=True)[1])
        raise PipelineError(f"TITAN_ARGS: torchtitan has no flag {', '.join(flags)}"
                            f"{f' (did you mean {hint}?)' if hint else ''}.", TITAN_ARGS_FIX)
    return parsed


TITAN_ARGS_FIX = "use torchtitan's --section.key flags (TITAN_ARGS=--help lists them), e.g. --training.steps 5."


def _report_lines(report: str) -> list[str]:
    """tyro's boxed console report as plain lines (box-drawing characters and rules removed)."""
    lines = []
    for line in report.splitlines():
        text = line.strip(" │╭╮╰╯─")
        if text and set(text) - set("─- "):
            lines.append(text)
    return lines


def _tyro_problem(report: str) -> str:
    lines = _report_lines(report)
    detail = next((line for line in lines[1:] if not line.startswith(("Argument helptext", "For full helptext"))), "")
    return detail or (lines[0] if lines else "torchtitan's parser refused it")


def _tyro_suggestion(report: str) -> str | None:
    lines = _report_lines(report)
    for number, line in enumerate(lines):
        if line.startswith(("Perhaps you meant", "Arguments similar to")) and number + 1 < len(lines):
            flag = lines[number + 1].split()[0]
            return flag if flag.startswith("--") else None
    return None
