"""pipeline/stages/report.py (`make report`): curves and summary from real runs, and the layouts a
model's runs/ can have."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.checkpoint.arch import arch_from_config
from pipeline.checkpoint.embedded import EMBEDDED
from pipeline.errors import PipelineError
from pipeline.run import store
from pipeline.run.settings import TrainSettings
from pipeline.run.rundir import RunDir
from pipeline.run.spec import RunSpec
from pipeline.outputs import report
from helpers import REPO, copy_model, read_metrics, run_dir as runs_dir, run_pipeline

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def real_runs(checkpoints, tmp_path_factory) -> Path:
    """tiny trained for real on two paths (native 3 steps, nki 2 steps) in a root of its own."""
    root = tmp_path_factory.mktemp("report_root")
    copy_model(checkpoints, root, "tiny")  # the shared download, so other tests' runs stay untouched
    run_pipeline("train", "--model", "tiny", "--path", "native", "--steps", "3", "--fresh", root=root)
    run_pipeline("train", "--model", "tiny", "--path", "nki", "--steps", "2", "--fresh", root=root)
    return root


def step1_cells(summary: str) -> dict[str, float]:
    """The step-1 loss each `## <path>` section of summary.md shows."""
    cells = {}
    for section in summary.split("\n## ")[1:]:
        match = re.search(r"^\| step-1 loss \| ([0-9.]+) \|$", section, re.M)
        assert match, section
        cells[section.splitlines()[0].strip()] = float(match.group(1))
    return cells


def check_png(path: Path) -> tuple[int, int]:
    from PIL import Image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        width, height = image.size
    assert 800 <= width <= 3000 and 500 <= height <= 3000, (width, height)
    return width, height


def test_report_of_real_runs(real_runs):
    result = run_pipeline("report", "--model", "tiny", root=real_runs)
    out = real_runs / "tiny" / "report"
    assert sorted(p.name for p in out.iterdir()) == ["curves.png", "summary.md"]
    check_png(out / "curves.png")
    summary = (out / "summary.md").read_text()
    assert summary in result.stdout  # the same summary on the terminal
    logged = {path: read_metrics(runs_dir(real_runs, "tiny", path))[0] for path in ("native", "nki")}
    assert all(record["step"] == 1 for record in logged.values())
    shown = step1_cells(summary)
    assert set(shown) == {"native", "nki"}
    for path, record in logged.items():
        assert shown[path] == pytest.approx(record["loss"], abs=5e-7), path
    assert "runs end at different steps (native 3, nki 2)" in summary
    assert re.search(r"no hf run \(.*tiny/runs/hf holds none\)", summary)
    assert "warning" not in result.stderr
    assert not list((real_runs / "tiny").glob(".report.*"))  # no temporary left beside it


def test_summary_values_come_from_the_metrics(real_runs):
    collection = report.collect(store.home("tiny", real_runs))
    native = next(r for r in collection.runs if r.path == "native")
    records = read_metrics(runs_dir(real_runs, "tiny", "native"))
    summary = report.summarize(native)
    assert summary.step1_loss == records[0]["loss"]
    assert summary.final_loss == records[-1]["loss"]
    assert summary.first_step_s == records[0]["step_time_s"]
    assert len(records) == 3
    assert summary.median_step_s == pytest.approx((records[1]["step_time_s"] + records[2]["step_time_s"]) / 2)
    assert summary.peak_memory_gib == max(r["memory_gib"] for r in records)
    assert summary.planned_steps == 3 and summary.last_step == 3


def _write_spec(run_dir: Path, steps: int) -> None:
    """run.json as the train stage writes it, planning `steps`."""
    RunDir(run_dir).save_spec(RunSpec(
        model="tiny", model_key="tiny", path=run_dir.name, target="cpu", source_dir=str(run_dir.parent.parent / "source"),
        run_dir=str(run_dir), arch=arch_from_config(EMBEDDED["tiny"].config), settings=TrainSettings(steps=steps)))


def _write_metrics(run_dir: Path, losses: list[float], steps_planned: int | None = None) -> None:
    run_dir.mkdir(parents=True)
    lines = [json.dumps({"step": i, "loss": loss, "grad_norm": 1.0 / i, "step_time_s": 10.0 if i == 1 else 0.5 + i,
                         "tokens_per_s": 100.0 * i, "tokens_per_s_per_rank": 50.0 * i, "mfu": 1.5 * i,
                         "peak_flops_per_rank": 1e12, "memory_gib": 2.0 + i, "memory_kind": "HBM reserved",
                         "time": 1.7e9 + i}) for i, loss in enumerate(losses, 1)]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if steps_planned is not None:
        _write_spec(run_dir, steps_planned)


def test_synthetic_layout_notes_warnings_and_verify(tmp_path):
    # Synthetic metrics (same schema as the trainer's) to reach layouts a short real run does not make.
    home = store.home("tiny", tmp_path)
    runs = home.runs
    _write_metrics(runs / "native", [3.0, 2.5, 2.0, 1.5, 1.25], steps_planned=5)
    _write_metrics(runs / "hf", [3.1, 2.6], steps_planned=4)
    (runs / "nki").mkdir()
    _write_spec(runs / "nki", 5)  # launched, died before step 1
    for beside in ("source", "data"):  # the model's other folders are not runs
        (home.dir / beside).mkdir()
    verify = {"passed": False, "checkpoint": "x", "reference": "y",
              "checks": [{"name": "load", "passed": False, "detail": "1 missing"},
                         {"name": "step1-loss-export", "passed": True, "detail": "ok"}],
              "missing_keys": ["lm_head.weight"], "unexpected_keys": [], "mismatched_keys": [],
              "step1_loss": {"export": 3.0, "logged": 3.0, "reference": None}}
    (runs / "native" / "verify.json").write_text(json.dumps(verify))

    collection = report.collect(home)
    assert [r.path for r in collection.runs] == ["hf", "native"]
    assert any(str(runs / "nki") in w and "no metrics.jsonl" in w for w in collection.warnings)
    out = report.write_report(collection, home.report)
    assert out == home.report
    summary = (out / "summary.md").read_text()
    check_png(out / "curves.png")
    assert step1_cells(summary) == {"hf": 3.1, "native": 3.0}
    assert "runs end at different steps (hf 2, native 5)" in summary
    assert "hf logged up to step 2 of 4" in summary
    assert f"warning: {runs / 'nki'} has no metrics.jsonl" in summary
    native = summary.split("## native")[1]
    assert "| verify | FAILED (1/2 checks); failed: load |" in native
    assert "| missing keys | 1: `lm_head.weight` |" in native
    assert "| unexpected keys | 0 |" in native
    assert "| step-1 loss check | passed: export 3.000000, logged 3.000000, reference — |" in native
    assert "| verify | not run (no verify.json) |" in summary.split("## hf")[1].split("## native")[0]
    assert "| median step after step 1 | 4.000 s |" in native  # steps 2..5: 2.5 3.5 4.5 5.5
    assert "| first step | 10.00 s" in native
    assert "| peak memory | 7.00 GiB (HBM reserved) |" in native


def test_dir_without_metrics_warns_and_cli_exits_zero(tmp_path):
    home = store.home("tiny", tmp_path / "ckpt")
    _write_metrics(home.runs / "native", [2.0, 1.0])
    (home.runs / "nki").mkdir()
    (home.runs / "nki" / "metrics.jsonl").write_text("")
    (home.runs / "mine").mkdir()  # what a launch that failed before its first step leaves
    (home.runs / "mine" / "failure.json").write_text(json.dumps({"rank": 0, "problem": "bad data.", "fix": "fix it."}))
    result = run_pipeline("report", "--model", "tiny", root=tmp_path / "ckpt")
    console = result.stdout + result.stderr
    assert console.count(f"warning: {home.runs / 'nki'} has an empty metrics.jsonl") == 1
    assert console.count(str(home.runs / "mine")) == 1  # named once, as the failed start it was
    assert f"warning: run mine failed before its first step: bad data. ({home.runs / 'mine' / 'failure.json'})" in console
    assert "no hf run" in result.stdout and "no nki run" not in result.stdout  # named once, as the warning
    check_png(home.report / "curves.png")


def test_torn_line_is_skipped_with_a_warning(tmp_path):
    home = store.home("tiny", tmp_path)
    _write_metrics(home.runs / "native", [2.0, 1.5, 1.0])
    with open(home.runs / "native" / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "loss": 0.9, "grad_')
    collection = report.collect(home)
    assert [r["step"] for r in collection.runs[0].records] == [1, 2, 3]
    assert any("metrics.jsonl:4 is not JSON" in w for w in collection.warnings)


def test_no_metrics_anywhere_is_an_error_and_keeps_the_old_report(tmp_path):
    home = store.home("tiny", tmp_path / "ckpt")
    (home.runs / "native").mkdir(parents=True)
    home.report.mkdir()
    (home.report / "summary.md").write_text("old")
    result = run_pipeline("report", "--model", "tiny", root=tmp_path / "ckpt", check=False)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0  # one line, no traceback
    assert "error: no run under" in result.stderr and "(without: native)" in result.stderr and "Fix:" in result.stderr
    assert (home.report / "summary.md").read_text() == "old"
    with pytest.raises(PipelineError, match="does not exist"):
        report.collect(store.home("tiny", tmp_path / "nowhere"))


def test_failed_drawing_leaves_no_report(tmp_path, monkeypatch):
    home = store.home("tiny", tmp_path)
    _write_metrics(home.runs / "native", [2.0, 1.0])
    collection = report.collect(home)

    def broken(collection, output):
        output.write_bytes(b"half")
        raise RuntimeError("disk full")

    monkeypatch.setattr(report, "draw_curves", broken)
    with pytest.raises(RuntimeError):
        report.write_report(collection, home.report)
    assert not home.report.exists()
    assert sorted(p.name for p in home.dir.iterdir()) == ["runs"]


def test_no_window_backend_is_touched(tmp_path):
    home = store.home("tiny", tmp_path)
    _write_metrics(home.runs / "native", [2.0, 1.0])
    code = ("import sys; from pathlib import Path; from pipeline.run import store; from pipeline.outputs import report; "
            f"home = store.home('tiny', Path({str(tmp_path)!r})); report.write_report(report.collect(home), home.report); "
            "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'")
    # Even a GUI backend asked for by the environment is never used: the Agg canvas is built directly.
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "MPLBACKEND": "TkAgg", "DISPLAY": ""})
    assert result.returncode == 0, result.stderr
    check_png(home.report / "curves.png")


# Seven runs as a user has them: the three paths pretraining, and named runs (chat fine-tuning on two paths,
# one more pretraining run), every step-1 loss equal (what comparing paths is for) and close curves.
SEVEN = {"hf": ("hf", "text"), "native": ("native", "text"), "nki": ("nki", "text"), "mine-2": ("nki", "text"),
         "sft": ("native", "chat"), "lora": ("native", "chat"), "mine": ("hf", "chat")}


def seven_runs(root: Path) -> store.ModelHome:
    home = store.home("tiny", root)
    for i, (name, (path, data_format)) in enumerate(SEVEN.items()):
        run = home.runs / name
        _write_metrics(run, [7.882170] + [7.5 - 0.02 * i - 0.1 * s for s in range(1, 10)])
        if data_format == "chat":
            lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for line in lines:
                if line["step"] in (1, 5, 10):
                    line["eval_loss"] = line["loss"] + 0.3
            (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        RunDir(run).save_spec(RunSpec(
            model="tiny", model_key="tiny", path=path, target="cpu", source_dir=str(home.runs.parent / "source"),
            run_dir=str(run), arch=arch_from_config(EMBEDDED["tiny"].config), settings=TrainSettings(steps=10),
            data_format=data_format))
    return home


def test_seven_runs_are_told_apart(tmp_path):
    from matplotlib.colors import to_rgba
    from matplotlib.text import Text
    from matplotlib.transforms import Bbox

    from pipeline.models import registry

    collection = report.collect(seven_runs(tmp_path))
    figure = report.figure(collection)
    renderer = figure.canvas.get_renderer()
    figure.draw(renderer)
    pretraining, chat = figure.axes[0], figure.axes[1]
    drawn = {ax: {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
             for ax in (pretraining, chat)}
    assert set(drawn[pretraining]) == {"hf", "native", "nki", "mine-2 (nki)"}  # the kinds in panels of their own
    assert set(drawn[chat]) == {"sft (native)", "lora (native)", "mine (hf)"}
    lines = {**drawn[pretraining], **drawn[chat]}
    colours = [to_rgba(line.get_color()) for line in lines.values()]
    markers = [line.get_marker() for line in lines.values()]
    assert len(set(colours)) == len(set(markers)) == 7  # a colour and a marker per run
    for path in registry.names():  # path runs keep their colours
        assert to_rgba(lines[path].get_color()) == to_rgba(registry.PATHS[path].colour)
    evals = [line for line in chat.get_lines() if line.get_label().startswith("_") and line.get_linestyle() == ":"]
    assert len(evals) == 3 and all(len(line.get_xdata()) == 3 for line in evals)  # eval loss drawn, per chat run
    labels = [t for ax in figure.axes for t in ax.texts if t.get_gid() == "step1-label"]
    assert sorted(t.get_text().split(" step 1")[0] for t in labels) == sorted(SEVEN)
    legend = figure.axes[5].get_legend()
    legend_texts = [t.get_text() for t in legend.get_texts()]
    assert all(any(t.startswith(name) for t in legend_texts) for name in SEVEN) and legend.get_title().get_text() == "runs"
    for group in ([t for t in labels if t.axes is pretraining], [t for t in labels if t.axes is chat], legend.get_texts()):
        boxes = [Text.get_window_extent(t, renderer) for t in group]  # the text's own box (an annotation's holds its arrow)
        for i, a in enumerate(boxes):
            assert Bbox.intersection(a, figure.bbox) is not None and a.x0 >= 0 and a.x1 <= figure.bbox.x1
            for b in boxes[i + 1:]:
                assert not a.overlaps(b), (a, b)
    output = os.environ.get("REPORT_PNG")  # REPORT_PNG=<file>: keep the picture to look at
    if output:
        figure.savefig(output, format="png")
