"""`make pipeline` as a user runs it, on the embedded default (tiny and tiny-moe side by side): a console of about 25
lines a run (no torchtitan start-up log or repeated warnings, each step `step n/N` with loss, tokens/s and ETA, verify
in one line), each model's whole and in order, ending with the summary table whose cells are what the runs wrote; a
model that fails stops the one beside it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import pytest

from helpers import REPO, copy_model, pipeline_env, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")]

STEPS = 3
MODELS = ("tiny", "tiny-moe")  # the embedded default, in its order
# One run's share of the console: its header, download and data (4 lines: text, chat, preference pairs), the memory
# estimate, the launch line, the ranks' torchtitan API, STEPS step lines, the hidden-lines note, export and verify:
# 11 + STEPS, and one to spare (a report's warning).
LINES_PER_RUN = 12 + STEPS


def _make_pipeline(root, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "IN_CONTAINER", "PIPELINE_VERBOSE")}
    return subprocess.run(["make", "--no-print-directory", "pipeline", *args], cwd=REPO, env=pipeline_env(root, env),
                          capture_output=True, text=True, timeout=1200)


def _both_models(checkpoints, root):
    for model in MODELS:
        copy_model(checkpoints, root, model, link=True)
    return root


def test_make_pipeline_is_quiet_and_ends_with_the_summary_table(checkpoints, tmp_path):
    """The embedded default: tiny's and tiny-moe's runs side by side, their consoles one after the other."""
    root = _both_models(checkpoints, tmp_path / "root")
    result = _make_pipeline(root, "PATHS=native", f"STEPS={STEPS}")
    console = result.stdout + result.stderr
    assert result.returncode == 0, console[-4000:]
    lines = result.stdout.splitlines()
    table_at = lines.index("== summary")
    # every line either stream printed before the table: the first model's download (run before the two chains),
    # the two runs and the reports, nothing else
    assert table_at + len(result.stderr.splitlines()) <= 1 + 2 * LINES_PER_RUN, console
    assert len(lines) == table_at + 1 + 2 + 2, result.stdout  # the table: header, rule, one row per run
    for noise in ("Peak flops undefined", "lspci", "OMP_NUM_THREADS", "Building device mesh", "UserWarning"):
        assert noise not in console
    assert not re.search(r"^\[\d+\][-+ ]+(Done|Exit|Terminated)", console, re.M)  # no job-control notices
    assert "Traceback" not in console and "error:" not in console
    steps = [n for n, line in enumerate(lines) if re.fullmatch(
        rf"\[rank0\]:step +\d+/{STEPS}  loss \d+\.\d{{6}}  [\d,]+ tokens/s  ETA \d+:\d\d", line)]
    assert len(steps) == 2 * STEPS
    assert len(re.findall(r"^verify: PASSED (\d+)/\1 checks ", result.stdout, re.M)) == 2  # one line, no table
    # each model's console whole, in MODELS order, although they ran at once
    headers = [lines.index(f"== {model} native: train → export → verify") for model in MODELS]
    reports = [lines.index(f"report: {root / model / 'report'}") for model in MODELS]
    assert headers[0] < max(steps[:STEPS]) < reports[0] < headers[1] < min(steps[STEPS:]) < reports[1] < table_at

    header, rule, *rows = lines[table_at + 1:]
    assert header.split() == ["model", "path", "step-1", "loss", "transformers", "last", "loss", "eval", "loss",
                              "export", "verify"]
    assert set(rule.replace(" ", "")) == {"-"}
    for line, model in zip(rows, MODELS):
        run = root / model / "runs" / "native"
        metrics, verify = read_metrics(run), json.loads((run / "verify.json").read_text())
        cells = re.split(r"\s{2,}", line.strip())
        assert cells[:2] == [model, "native"]
        assert cells[2] == f"{metrics[0]['loss']:.6f}" and metrics[0]["step"] == 1
        assert cells[3] == f"{verify['step1_loss']['reference']:.6f}"  # plain transformers, beside it
        assert abs(float(cells[2]) - float(cells[3])) < 1e-3
        assert cells[4] == f"{metrics[-1]['loss']:.6f} (step {STEPS})"
        assert cells[5] == "—"  # the pretraining runs hold nothing out
        # the embedded default exports float32 (exact comparisons); MODELS= exports bfloat16
        assert cells[6] == json.loads((run / "export" / "config.json").read_text())["dtype"] == "float32"
        assert cells[7] == f"passed ({len(verify['checks'])}/{len(verify['checks'])} checks)" and verify["passed"]


def test_a_failing_model_stops_the_one_beside_it(checkpoints, tmp_path):
    """tiny's first train fails at once (its runs/ is a file): tiny-moe's chain, running beside it, is stopped whole
    (its train, torchrun and ranks), nothing of it is left running, and make fails before the summary."""
    root = _both_models(checkpoints, tmp_path / "root")
    (root / "tiny" / "runs").write_text("not a folder\n")
    result = _make_pipeline(root, "PATHS=native", "STEPS=50")
    assert result.returncode != 0 and "== summary" not in result.stdout, result.stdout[-3000:]
    assert "== tiny native: train → export → verify" in result.stdout
    time.sleep(2)  # SIGTERM reached them as make returned
    left = subprocess.run(["pgrep", "-f", str(root)], capture_output=True, text=True).stdout.split()
    assert left == [], subprocess.run(["ps", "-o", "pid,args", "-p", ",".join(left)], capture_output=True, text=True).stdout
    assert not (root / "tiny-moe" / "runs" / "native" / "verify.json").exists()  # stopped before it finished
