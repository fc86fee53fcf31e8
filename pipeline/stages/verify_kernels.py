"""Stage `verify-kernels`: every nki override against an independent float32 implementation
(the cases and the comparison: pipeline.models.nki.kernel_check)."""

from __future__ import annotations

import argparse

from pipeline.errors import PipelineError
from pipeline.models.nki.kernel_check import THRESHOLDS, cases, table, verify


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="cpu or trn2 (trn2 runs the NKI kernels on `neuron`; detected when unset)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--overrides", default="", help="comma-separated overrides to check (default: all)")


def run(args: argparse.Namespace) -> list[dict]:
    from pipeline.models.nki import kernels
    from pipeline.models.nki.declarations import BY_FUNCTION
    from pipeline.run import targets

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in THRESHOLDS]
    if unknown:
        raise PipelineError(f"--dtypes {unknown} not supported.", f"use some of {sorted(THRESHOLDS)}.")
    chosen = [o.strip() for o in args.overrides.split(",") if o.strip()] or list(BY_FUNCTION)
    unknown = [o for o in chosen if o not in BY_FUNCTION]
    if unknown:
        raise PipelineError(f"--overrides {unknown} unknown.", f"use some of {', '.join(BY_FUNCTION)}.")
    lnc = kernels.lnc()
    selected = [c for c in cases(lnc) if c.override in chosen]
    rows = verify(selected, dtypes)
    reason = kernels.nki_unavailable_reason()
    if reason is None and targets.resolve(args.target).name != "trn2":  # detected when --target is unset
        reason = "the target is not trn2 (the kernels run on `neuron` devices: --target trn2)"
    if reason is None:
        rows += verify(selected, dtypes, device="neuron", use_nki=True)
    print(f"shapes for LNC={lnc} (NEURON_LOGICAL_NC_CONFIG, else trn2's default 2)")
    print(table(rows))
    if reason is not None:
        print(f"NKI kernels NOT run here: {reason}. Checked: every override's operator with its PyTorch reference "
              "dispatch (the path CPU training uses); on trn2 the same rows run the kernels.")
    failed = [r for r in rows if not r["pass"]]
    if failed:
        raise PipelineError(f"{len(failed)} of {len(rows)} kernel checks failed (see FAIL rows).",
                            "fix the operator or its adapter before training with --path nki.")
    return rows
