"""Curves and a summary of every run of one model → checkpoints/<key>/report/.

Reads each run's metrics.jsonl (and run.json / verify.json when present), draws
curves.png and writes summary.md, then prints the summary. Runs are shown as they are:
different step counts, missing paths and run directories without metrics become notes
and warnings, never a crash and never a silently dropped run.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_directory
from pipeline.models import registry
from pipeline.run import rundir, store
from pipeline.run.rundir import RunDir


@dataclass
class Run:
    path: str
    directory: Path
    records: list[dict]
    planned_steps: int | None = None
    verify: dict | None = None
    train_path: str | None = None  # run.json's path (a named run's folder is its RUN_NAME)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(r["step"], r[key]) for r in self.records if isinstance(r.get(key), (int, float))]
        return [s for s, _ in points], [v for _, v in points]


@dataclass
class RunSummary:
    path: str
    steps_logged: int
    last_step: int
    planned_steps: int | None
    step1_loss: float | None
    final_loss: float
    eval_losses: list[tuple[int, float]]  # (step, held-out eval loss), when the run computed it
    first_step_s: float | None
    median_step_s: float | None  # after the first (compile/warm-up) step
    median_tokens_per_s: float | None
    median_mfu: float | None
    peak_memory_gib: float | None
    memory_kind: str | None
    verify: dict | None


@dataclass
class Collection:
    model: str
    directory: Path
    runs: list[Run] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    without_metrics: list[str] = field(default_factory=list)  # run directories that are named in a warning


def collect(home: store.ModelHome) -> Collection:
    model = home.source.model
    if not home.runs.is_dir():
        raise PipelineError(f"{home.runs} does not exist: nothing has been run for {model!r}.",
                            f"run `make train-native MODEL={model}` first.")
    collection = Collection(model, home.runs)
    for run_dir in _run_dirs(home.runs):
        records = run_dir.metric_records(collection.warnings)
        if not records:
            what = "an empty" if run_dir.metrics.is_file() else "no"
            collection.warnings.append(f"{run_dir.path} has {what} {rundir.METRICS}; it is left out of the report.")
            collection.without_metrics.append(run_dir.name)
            continue
        collection.runs.append(Run(run_dir.name, run_dir.path, records, _planned_steps(run_dir),
                                   _read_verify(run_dir.verify, collection), _train_path(run_dir)))
    _add_notes(collection)
    if not collection.runs:
        empty = f" (without: {', '.join(collection.without_metrics)})" if collection.without_metrics else ""
        raise PipelineError(f"no run under {home.runs} has metrics ({rundir.METRICS}){empty}.",
                            f"train first, e.g. `make train-native MODEL={model}`.")
    return collection


def _run_dirs(runs: Path) -> list[RunDir]:
    """Known paths first, in the registry's order; any other run directory after them."""
    order = {name: i for i, name in enumerate(registry.names())}
    found = [RunDir(p) for p in runs.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return sorted(found, key=lambda r: (order.get(r.name, len(order)), r.name))


def _planned_steps(run_dir: RunDir) -> int | None:
    try:
        return run_dir.spec().settings.steps
    except (PipelineError, OSError, ValueError, KeyError, TypeError):
        return None


def _train_path(run_dir: RunDir) -> str | None:
    try:
        return run_dir.spec().path
    except (PipelineError, OSError, ValueError, KeyError, TypeError):
        return None


def _read_verify(path: Path, collection: Collection) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        collection.warnings.append(f"{path} is unreadable ({err}); its verify result is left out.")
        return None
    if not isinstance(data, dict) or "passed" not in data:
        collection.warnings.append(f"{path} has no 'passed' field; its verify result is left out.")
        return None
    return data


def _add_notes(collection: Collection) -> None:
    present = {r.path for r in collection.runs} | {r.train_path for r in collection.runs}
    for path in registry.names():
        if path not in present and path not in collection.without_metrics:
            collection.notes.append(f"no {path} run ({collection.directory / path} holds none).")
    last_steps = {r.path: r.records[-1]["step"] for r in collection.runs}
    if len(set(last_steps.values())) > 1:
        listed = ", ".join(f"{p} {s}" for p, s in last_steps.items())
        collection.notes.append(f"runs end at different steps ({listed}); each is drawn as logged.")
    for r in collection.runs:
        if r.planned_steps is not None and r.records[-1]["step"] < r.planned_steps:
            collection.notes.append(f"{r.path} logged up to step {r.records[-1]['step']} of {r.planned_steps} "
                                    "(stopped early, or still running).")


def summarize(r: Run) -> RunSummary:
    first, rest = r.records[0], r.records[1:]
    step1 = next((rec["loss"] for rec in r.records if rec["step"] == 1), None)
    memory = [rec["memory_gib"] for rec in r.records if isinstance(rec.get("memory_gib"), (int, float))]
    return RunSummary(
        path=r.path, steps_logged=len(r.records), last_step=r.records[-1]["step"], planned_steps=r.planned_steps,
        step1_loss=step1, final_loss=r.records[-1]["loss"], eval_losses=list(zip(*r.series("eval_loss"))),
        first_step_s=first.get("step_time_s") if first["step"] == 1 else None,
        median_step_s=_median(rest, "step_time_s"), median_tokens_per_s=_median(rest, "tokens_per_s"),
        median_mfu=_median(rest, "mfu"), peak_memory_gib=max(memory) if memory else None,
        memory_kind=next((rec["memory_kind"] for rec in reversed(r.records) if rec.get("memory_kind")), None),
        verify=r.verify,
    )


def _median(records: list[dict], key: str) -> float | None:
    values = [rec[key] for rec in records if isinstance(rec.get(key), (int, float))]
    return statistics.median(values) if values else None


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{unit}"


def render_summary(collection: Collection, summaries: list[RunSummary]) -> str:
    lines = [f"# Report: {collection.model}", "", f"Runs under `{collection.directory}`; curves in `curves.png`.", ""]
    if collection.notes or collection.warnings:
        lines += ["Notes:", ""] + [f"- {n}" for n in collection.notes] + [f"- warning: {w}" for w in collection.warnings]
        lines.append("")
    for s in summaries:
        steps = f"{s.steps_logged} logged, last {s.last_step}" + (f" of {s.planned_steps}" if s.planned_steps else "")
        rows = [
            ("steps", steps),
            ("step-1 loss", _fmt(s.step1_loss, ".6f") if s.step1_loss is not None else "— (step 1 not logged)"),
            ("final loss", f"{s.final_loss:.6f} (step {s.last_step})"),
            ("eval loss (held out)", _eval_cell(s.eval_losses)),
            ("first step", _fmt(s.first_step_s, ".2f", " s") + " (includes compile/warm-up)"),
            ("median step after step 1", _fmt(s.median_step_s, ".3f", " s")),
            ("median tokens/s after step 1", _fmt(s.median_tokens_per_s, ",.1f", " (all ranks)")),
            ("median MFU after step 1", _fmt(s.median_mfu, ".2f", " %")),
            ("peak memory", _fmt(s.peak_memory_gib, ".2f", " GiB") + (f" ({s.memory_kind})" if s.memory_kind else "")),
            ("verify", _verify_cell(s.verify)),
        ]
        if s.verify is not None:
            rows += _verify_rows(s.verify)
        lines += [f"## {s.path}", "", "| metric | value |", "|---|---|"]
        lines += [f"| {name} | {value} |" for name, value in rows]
        lines.append("")
    return "\n".join(lines)


def _eval_cell(points: list[tuple[int, float]]) -> str:
    if not points:
        return "— (no eval: eval_every = 0 or no held-out split)"
    (first_step, first), (last_step, last) = points[0], points[-1]
    return f"{first:.6f} (step {first_step}) → {last:.6f} (step {last_step}), {len(points)} evals"


def _verify_cell(verify: dict | None) -> str:
    if verify is None:
        return "not run (no verify.json)"
    checks = verify.get("checks") or []
    failed = [c.get("name", "?") for c in checks if not c.get("passed")]
    verdict = "passed" if verify.get("passed") else "FAILED"
    return f"{verdict} ({len(checks) - len(failed)}/{len(checks)} checks)" + (f"; failed: {', '.join(failed)}" if failed else "")


def _verify_rows(verify: dict) -> list[tuple[str, str]]:
    rows = []
    for kind in ("missing", "unexpected", "mismatched"):
        keys = verify.get(f"{kind}_keys") or []
        shown = ", ".join(f"`{k}`" for k in keys[:5]) + (f" … (+{len(keys) - 5})" if len(keys) > 5 else "")
        rows.append((f"{kind} keys", f"{len(keys)}" + (f": {shown}" if keys else "")))
    losses = verify.get("step1_loss") or {}
    check = next((c for c in verify.get("checks") or [] if str(c.get("name", "")).startswith("step1-loss")), None)
    values = ", ".join(f"{k} {_fmt(losses.get(k), '.6f')}" for k in ("export", "logged", "reference"))
    verdict = "" if check is None else ("passed: " if check.get("passed") else "FAILED: ")
    rows.append(("step-1 loss check", f"{verdict}{values}"))
    return rows


def _look(path: str) -> registry.TrainingPath:
    """A path's colour and line style; a run directory of no known path gets a neutral look."""
    return registry.PATHS.get(path) or registry.TrainingPath(path, "", build=lambda spec: None)


def draw_curves(collection: Collection, output: Path) -> None:
    # Figure + the Agg canvas directly, not pyplot: no backend selection, no window, no global state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(13, 8.5), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2, sharex=True)
    kinds = sorted({rec["memory_kind"] for r in collection.runs for rec in r.records if rec.get("memory_kind")})
    panels = [
        ("loss", "loss (cross-entropy, nats)", "Training loss"),
        ("grad_norm", "grad norm (L2, before clipping)", "Gradient norm"),
        ("tokens_per_s", "tokens/s (all ranks)", "Throughput"),
        ("memory_gib", f"memory (GiB{', ' + ', '.join(kinds) if kinds else ''})", "Peak memory"),
    ]
    for ax, (key, ylabel, title) in zip(axes.flat, panels):
        for r in collection.runs:
            steps, values = r.series(key)
            if steps:
                linestyle, marker = _look(r.path).line
                ax.plot(steps, values, linestyle=linestyle, marker=marker, markersize=4, linewidth=1.8,
                        color=_look(r.path).colour, label=r.path)
            if key == "loss" and r.series("eval_loss")[0]:  # held-out eval loss beside the training loss
                ax.plot(*r.series("eval_loss"), linestyle=":", marker="s", markersize=5, linewidth=1.5,
                        color=_look(r.path).colour, label=f"{r.path} eval (held out)")
        ax.set_title(title, fontsize=12)
        ax.set_ylabel(ylabel, fontsize=10)
        ax.grid(True, alpha=0.3)
    loss_ax = axes.flat[0]
    marked = 0
    for r in collection.runs:
        step1 = next((rec["loss"] for rec in r.records if rec["step"] == 1), None)
        if step1 is not None:
            loss_ax.scatter([1], [step1], s=90, marker="*", zorder=3, color=_look(r.path).colour, edgecolors="black")
            # Stacked labels: equal step-1 losses (the point of comparing paths) would otherwise overprint.
            loss_ax.annotate(f"{r.path} step 1: {step1:.6f}", (1, step1), xytext=(10, 6 - 13 * marked),
                             textcoords="offset points", fontsize=9, color=_look(r.path).colour)
            marked += 1
    for ax in axes[1]:
        ax.set_xlabel("step", fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    loss_ax.legend(title="path", fontsize=9)
    figure.suptitle(f"{collection.model}: {len(collection.runs)} run(s) — {', '.join(r.path for r in collection.runs)}",
                    fontsize=14)
    figure.savefig(output, format="png")


def write_report(collection: Collection, target: Path) -> Path:
    summaries = [summarize(r) for r in collection.runs]
    with atomic_directory(target, replace=True) as tmp:
        # mkdtemp makes the directory 0700; a report is for everyone who may read the checkpoints.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        draw_curves(collection, tmp / "curves.png")
        (tmp / "summary.md").write_text(render_summary(collection, summaries))
    return target
