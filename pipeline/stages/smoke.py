"""Stage `smoke`: the first contact with the devices, before any training (pipeline.host.smoke): device
count, one op, a two-rank all-reduce, the RoPE kernel at the run's LNC. `make smoke` runs verify-kernels
after it."""

from __future__ import annotations

import argparse

from pipeline.errors import PipelineError
from pipeline.host import smoke
from pipeline.run import targets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="cpu or trn2 (detected when unset; trn2 needs its devices)")


def run(args: argparse.Namespace) -> list[smoke.Row]:
    from pipeline.models.nki import kernels

    target = targets.resolve(args.target).name
    lnc = kernels.lnc()
    rows = smoke.run(target, lnc)
    print(smoke.table(rows, target, lnc), flush=True)
    failed = [r.name for r in rows if r.status == smoke.FAIL]
    if failed:
        raise PipelineError(f"smoke: {', '.join(failed)} failed on {target} (see the FAIL rows).",
                            "docs/trn2.md (First contact) says what each row means and what to record.")
    return rows
