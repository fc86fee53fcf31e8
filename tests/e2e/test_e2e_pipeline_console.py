"""`make pipeline` as a user runs it, on the embedded tiny: a console of about 25 lines a run (no torchtitan
start-up log or repeated warnings, each step `step n/N` with loss, tokens/s and ETA, verify in one line), ending
with the summary table whose cells are what the runs wrote."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest

from helpers import REPO, copy_model, pipeline_env, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")]

STEPS = 3
# One run's share of the console: its header, download and data (4 lines: text, chat, preference pairs), the memory
# estimate, the launch line, the ranks' torchtitan API, STEPS step lines, the hidden-lines note, export and verify:
# 11 + STEPS, and one to spare (a report's warning).
LINES_PER_RUN = 12 + STEPS


def test_make_pipeline_is_quiet_and_ends_with_the_summary_table(checkpoints, tmp_path):
    root = copy_model(checkpoints, tmp_path / "root", link=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "IN_CONTAINER", "PIPELINE_VERBOSE")}
    result = subprocess.run(["make", "--no-print-directory", "pipeline", "MODELS=tiny", "PATHS=native hf",
                             f"STEPS={STEPS}"], cwd=REPO, env=pipeline_env(root, env), capture_output=True, text=True,
                            timeout=1200)
    console = result.stdout + result.stderr
    assert result.returncode == 0, console[-4000:]
    lines = result.stdout.splitlines()
    table_at = lines.index("== summary")
    # every line either stream printed before the table: the two runs and the report, nothing else
    assert table_at + len(result.stderr.splitlines()) <= 2 * LINES_PER_RUN, console
    assert len(lines) == table_at + 1 + 2 + 2, result.stdout  # the table: header, rule, one row per run
    for noise in ("Peak flops undefined", "lspci", "OMP_NUM_THREADS", "Building device mesh", "UserWarning"):
        assert noise not in console
    assert "Traceback" not in console and "error:" not in console
    assert len(re.findall(rf"^\[rank0\]:step +\d+/{STEPS}  loss \d+\.\d{{6}}  [\d,]+ tokens/s  ETA \d+:\d\d$",
                          result.stdout, re.M)) == 2 * STEPS
    assert len(re.findall(r"^verify: PASSED (\d+)/\1 checks ", result.stdout, re.M)) == 2  # one line, no table
    assert result.stdout.count("== tiny native: train → export → verify") == 1

    header, rule, *rows = lines[table_at + 1:]
    assert header.split() == ["model", "path", "step-1", "loss", "transformers", "last", "loss", "eval", "loss",
                              "export", "verify"]
    assert set(rule.replace(" ", "")) == {"-"}
    for line, path in zip(rows, ("native", "hf")):
        run = root / "tiny" / "runs" / path
        metrics, verify = read_metrics(run), json.loads((run / "verify.json").read_text())
        cells = re.split(r"\s{2,}", line.strip())
        assert cells[:2] == ["tiny", path]
        assert cells[2] == f"{metrics[0]['loss']:.6f}" and metrics[0]["step"] == 1
        assert cells[3] == f"{verify['step1_loss']['reference']:.6f}"  # plain transformers, beside it
        assert abs(float(cells[2]) - float(cells[3])) < 1e-3
        assert cells[4] == f"{metrics[-1]['loss']:.6f} (step {STEPS})"
        assert cells[5] == "—"  # the pretraining runs hold nothing out
        assert cells[6] == json.loads((run / "export" / "config.json").read_text())["dtype"] == "bfloat16"
        assert cells[7] == f"passed ({len(verify['checks'])}/{len(verify['checks'])} checks)" and verify["passed"]
