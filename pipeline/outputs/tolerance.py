"""The tolerance verify gates a run's logged step-1 loss by, against plain transformers' loss of the
source on the same batch (check step1-loss-source), and what it rests on.

A difference is a fact about the target's arithmetic (its precision, its kernels, its reductions), so
the tolerance is one measured on the run's own target: on CPU the figures of pipeline/dtypes.py
(measured on the embedded tiny model), on any other target an entry of configs/step1_tolerance.toml
recorded from runs there. With neither, verify reports the difference and does not gate on it: a
figure measured on tiny in float32 says nothing about a 36-layer bf16 model on trn2.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from pipeline.dtypes import DTYPES
from pipeline.errors import PipelineError
from pipeline.run.settings import CONFIG_DIR

TOLERANCE_FILE = CONFIG_DIR / "step1_tolerance.toml"
MEASURED_ON_CPU = "pipeline/dtypes.py (measured on the embedded tiny model on CPU)"


@dataclass(frozen=True)
class Tolerance:
    value: float
    basis: str  # what the figure rests on


def logged_loss(target: str, dtype: str, path: Path | None = None) -> Tolerance | None:
    """The recorded tolerance for runs on `target` training in `dtype`, or None (report, do not gate)."""
    path = path or TOLERANCE_FILE
    where = f"{path} [{target}.{dtype}]"
    try:
        entry = tomllib.loads(path.read_text()).get(target, {}).get(dtype)
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise PipelineError(f"{path} cannot be read ({type(err).__name__}: {err}).",
                            "fix the file (its header says what an entry holds).") from err
    if entry is not None:
        value, measured, source = entry.get("tolerance"), entry.get("measured"), entry.get("source")
        if not (isinstance(value, (int, float)) and value > 0 and isinstance(measured, list) and measured
                and all(isinstance(m, (int, float)) for m in measured) and isinstance(source, str) and source):
            raise PipelineError(f"{where} needs tolerance > 0, measured = [each run's |diff|] and source.",
                                "record it as the file's header shows, from runs on that target.")
        if max(measured) > value:
            raise PipelineError(f"{where}: tolerance {value} is below a difference it records ({max(measured)}).",
                                "give a tolerance above every measured difference.")
        return Tolerance(float(value), f"{where}: measured {measured}, {source}")
    if target == "cpu" and dtype in DTYPES:
        return Tolerance(DTYPES[dtype].logged_loss, MEASURED_ON_CPU)
    return None
