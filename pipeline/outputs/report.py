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
from pipeline.fsutil import atomic_directory, read_small_text
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
    kind: str = "pretraining"  # or "chat" (run.json's data_format): drawn in a loss panel of its own

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
            failure = run_dir.recorded_failure()
            if failure is not None:  # what a launch that failed before its first step leaves (failure.json)
                collection.warnings.append(f"run {run_dir.name} failed before its first step: {failure.get('problem')} "
                                           f"({run_dir.failure}); it is left out of the report.")
            else:
                what = "an empty" if run_dir.metrics.is_file() else "no"
                collection.warnings.append(f"{run_dir.path} has {what} {rundir.METRICS}; it is left out of the report.")
            collection.without_metrics.append(run_dir.name)
            continue
        collection.runs.append(Run(run_dir.name, run_dir.path, records, _planned_steps(run_dir),
                                   _read_verify(run_dir.verify, collection), _train_path(run_dir), _kind(run_dir)))
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


def _kind(run_dir: RunDir) -> str:
    try:
        return "chat" if run_dir.spec().data_format == "chat" else "pretraining"
    except (PipelineError, OSError, ValueError, KeyError, TypeError):
        return "pretraining"


def _read_verify(path: Path, collection: Collection) -> dict | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(read_small_text(path))
    except (OSError, json.JSONDecodeError, PipelineError) as err:
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
            ("verify", verify_cell(s.verify)),
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


def verify_cell(verify: dict | None) -> str:
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


# Named runs (sft, lora, mine, …) take these in turn: none is a path's colour or marker, so a path's run keeps
# its look from report to report and no two runs of one report share a colour or a marker (up to 10 named runs).
RUN_COLOURS = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "black", "gold",
               "navy", "lime")
RUN_MARKERS = ("D", "v", "P", "X", "*", "h", "<", ">", "p", "d")
KINDS = (("pretraining", "Training loss: pretraining"), ("chat", "Training loss: chat fine-tuning (eval loss dotted)"))


@dataclass(frozen=True)
class Look:
    colour: str
    linestyle: str
    marker: str


def looks(runs: list[Run]) -> dict[str, Look]:
    """One look per run: a path's run (its folder is the path's name) the registry's; every other run the next
    unused colour and marker, in the line style of the path it trained on."""
    found, named = {}, 0
    taken_colours = {p.colour for p in registry.PATHS.values()}
    taken_markers = {p.line[1] for p in registry.PATHS.values()}
    colours = [c for c in RUN_COLOURS if c not in taken_colours]
    markers = [m for m in RUN_MARKERS if m not in taken_markers]
    for r in runs:
        if r.path in registry.PATHS:
            entry = registry.PATHS[r.path]
            found[r.path] = Look(entry.colour, entry.line[0], entry.line[1])
            continue
        base = registry.PATHS.get(r.train_path or "")
        found[r.path] = Look(colours[named % len(colours)], base.line[0] if base else "-", markers[named % len(markers)])
        named += 1
    return found


def _label(r: Run) -> str:
    return r.path if r.train_path in (None, r.path) else f"{r.path} ({r.train_path})"


def draw_curves(collection: Collection, output: Path) -> None:
    figure(collection).savefig(output, format="png")


def figure(collection: Collection):
    """The curves of every run: a loss panel per kind of run (pretraining, chat), grad norm, throughput and
    memory, and a panel holding the legend."""
    # Figure + the Agg canvas directly, not pyplot: no backend selection, no window, no global state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    drawn = Figure(figsize=(16, 9), dpi=100, layout="constrained")
    FigureCanvasAgg(drawn)
    axes = drawn.subplots(2, 3)
    look = looks(collection.runs)
    kinds = sorted({rec["memory_kind"] for r in collection.runs for rec in r.records if rec.get("memory_kind")})
    for (kind, title), ax in zip(KINDS, axes[0][:2]):
        runs = [r for r in collection.runs if r.kind == kind]
        for r in runs:
            _plot(ax, r, "loss", look[r.path])
            if r.series("eval_loss")[0]:  # held-out eval loss beside the training loss: dotted, hollow markers
                a = look[r.path]
                ax.plot(*r.series("eval_loss"), linestyle=":", marker=a.marker, markersize=7, linewidth=1.5,
                        color=a.colour, markerfacecolor="white")
        _label_step1(ax, runs, look)
        _decorate(ax, title, "loss (cross-entropy, nats)")
        if not runs:
            ax.text(0.5, 0.5, f"no {kind} run", transform=ax.transAxes, ha="center", va="center", color="gray")
    panels = [
        (axes[0][2], "grad_norm", "grad norm (L2, before clipping)", "Gradient norm"),
        (axes[1][0], "tokens_per_s", "tokens/s (all ranks)", "Throughput"),
        (axes[1][1], "memory_gib", f"memory (GiB{', ' + ', '.join(kinds) if kinds else ''})", "Peak memory"),
    ]
    for ax, key, ylabel, title in panels:
        for r in collection.runs:
            _plot(ax, r, key, look[r.path])
        _decorate(ax, title, ylabel)
    # The legend has a panel of its own: it never covers a curve, and names every run (with its path).
    legend_ax = axes[1][2]
    legend_ax.axis("off")
    handles = [Line2D([], [], color=look[r.path].colour, linestyle=look[r.path].linestyle,
                      marker=look[r.path].marker, markersize=7, linewidth=1.8, label=f"{_label(r)}: {r.kind}")
               for r in collection.runs]
    if any(r.series("eval_loss")[0] for r in collection.runs):
        handles.append(Line2D([], [], color="gray", linestyle=":", marker="o", markerfacecolor="white",
                              label="eval loss (held out), in the run's colour"))
    handles.append(Line2D([], [], color="gray", linestyle="", marker="*", markersize=12, markeredgecolor="black",
                          label="step-1 loss (value labelled)"))
    legend_ax.legend(handles=handles, title="runs", loc="upper left", fontsize=10, title_fontsize=11, frameon=False)
    drawn.suptitle(f"{collection.model}: {len(collection.runs)} run(s)", fontsize=14)
    return drawn


def _plot(ax, r: Run, key: str, look: Look) -> None:
    steps, values = r.series(key)
    if steps:
        ax.plot(steps, values, linestyle=look.linestyle, marker=look.marker, markersize=5, linewidth=1.8,
                color=look.colour, label=_label(r))


def _decorate(ax, title: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=12)
    ax.set_ylabel(ylabel, fontsize=10)
    ax.set_xlabel("step", fontsize=10)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)


def _label_step1(ax, runs: list[Run], look: dict[str, Look]) -> None:
    """A star at each run's step-1 loss and its value, the labels stacked in one column at the panel's right
    (highest loss on top), one line apart: equal step-1 losses (the point of comparing paths) never overprint."""
    marked = sorted(((rec["loss"], r) for r in runs for rec in r.records if rec["step"] == 1),
                    key=lambda item: -item[0])
    for i, (loss, r) in enumerate(marked):
        a = look[r.path]
        ax.scatter([1], [loss], s=110, marker="*", zorder=3, color=a.colour, edgecolors="black")
        ax.annotate(f"{r.path} step 1: {loss:.6f}", (1, loss), xytext=(0.98, 0.97 - 0.075 * i),
                    textcoords="axes fraction", ha="right", va="top", fontsize=8.5, color=a.colour, gid="step1-label",
                    bbox=dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none", alpha=0.8),
                    arrowprops=dict(arrowstyle="-", color=a.colour, alpha=0.4, linewidth=0.8))


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
