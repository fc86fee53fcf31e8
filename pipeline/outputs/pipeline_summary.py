"""The table `make pipeline` ends with: one row per run it made (model × path), read back from the runs
themselves (metrics.jsonl, export/, verify.json), so it says what is on disk, not what a stage printed."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.errors import PipelineError
from pipeline.fsutil import read_json_object
from pipeline.outputs.report import verify_cell
from pipeline.run import store
from pipeline.run.rundir import RunDir

COLUMNS = ("model", "path", "step-1 loss", "transformers", "last loss", "eval loss", "export", "verify")


@dataclass(frozen=True)
class Row:
    model: str
    path: str
    step1_loss: str
    transformers: str  # plain transformers' loss of the source on the run's first batch (verify's reference)
    last_loss: str
    eval_loss: str
    export: str
    verify: str

    def cells(self) -> tuple[str, ...]:
        return (self.model, self.path, self.step1_loss, self.transformers, self.last_loss, self.eval_loss,
                self.export, self.verify)


def _loss(value) -> str:
    return f"{value:.6f}" if isinstance(value, (int, float)) else "—"


def row(model: str, run: RunDir, path: str) -> Row:
    records = run.metric_records()
    verify = _read_json(run.verify)
    evals = [r for r in records if isinstance(r.get("eval_loss"), (int, float))]
    last = records[-1] if records else None
    return Row(
        model=model, path=path,
        step1_loss=_loss(run.step1_loss()),
        transformers=_loss(((verify or {}).get("step1_loss") or {}).get("reference")),
        last_loss=f"{last['loss']:.6f} (step {last['step']})" if last else "— (no step logged)",
        eval_loss=f"{evals[-1]['eval_loss']:.6f} (step {evals[-1]['step']})" if evals else "—",
        export=_export_cell(run),
        verify=verify_cell(verify),
    )


def _export_cell(run: RunDir) -> str:
    config = _read_json(run.export / "config.json")
    if config is None:
        return "—"
    return str(config.get("dtype") or config.get("torch_dtype") or "yes")


def _read_json(path) -> dict | None:
    try:  # a regular file holding a JSON object, or nothing for the table (a FIFO there must not hang it)
        return read_json_object(path, "none: the table leaves it out.")
    except (OSError, PipelineError):
        return None


def rows(models: list[str], paths: list[str]) -> list[Row]:
    return [row(model, store.home(model).run(path), path) for model in models for path in paths]


def table(found: list[Row]) -> str:
    cells = [COLUMNS, *(r.cells() for r in found)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
