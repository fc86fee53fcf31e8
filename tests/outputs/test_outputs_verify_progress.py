"""verify shows its progress: each check is printed as it is decided (not only in the table at the
end), and comparing a big checkpoint's tensors shows a tqdm bar; verify.json and the table stay."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.checkpoint import stream
from pipeline.outputs import verify
from helpers import REPO
from tiny_checkpoint import small_random_checkpoint

# Full tier: each test here runs the CLI in a fresh interpreter (seconds apiece).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A small random Qwen3 (written by transformers, with the real tokenizer) and a copy of it."""
    root = tmp_path_factory.mktemp("verify")
    reference = small_random_checkpoint(root / "reference")
    checkpoint = root / "checkpoint"
    shutil.copytree(reference, checkpoint)
    return checkpoint, reference


def test_checks_are_printed_as_they_run(checkpoint_pair, tmp_path):
    checkpoint, reference = checkpoint_pair
    output = tmp_path / "verify.json"
    process = subprocess.Popen([sys.executable, "-m", "pipeline", "verify", "--checkpoint", str(checkpoint),
                                "--reference", str(reference), "--output", str(output)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines, json_when_first_check = [], None
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        if json_when_first_check is None and line.startswith("  files: "):
            # verify.json is written once, after the last check: the first check came out before that.
            json_when_first_check = output.exists()
    process.wait(timeout=300)
    stderr = process.stderr.read()
    assert process.returncode == 0, "\n".join(lines) + stderr
    assert json_when_first_check is False
    live_at = [i for i, line in enumerate(lines) if re.match(r"  [\w-]+: (pass|FAIL)  ", line)]
    live = [lines[i].split(":")[0].strip() for i in live_at]
    table_at = next(i for i, line in enumerate(lines) if line.startswith("verify ") and " against " in line)
    assert live[:5] == ["files", "load", "keys", "shapes", "dtypes"] and "step1-loss-export" in live
    assert max(live_at) < table_at
    recorded = json.loads(output.read_text())
    assert recorded["passed"] and [c["name"] for c in recorded["checks"]] == live  # the table and the file stay
    assert lines[-1] == f"PASSED → {output}"


def test_big_checkpoints_show_a_progress_bar(checkpoint_pair, tmp_path, monkeypatch, capsys):
    checkpoint, reference = checkpoint_pair
    monkeypatch.setattr(stream, "PROGRESS_MIN_BYTES", 0)  # this small one counts as big
    result = verify.verify(checkpoint, reference, None, tmp_path / "verify.json")
    assert result.passed
    err = capsys.readouterr().err
    assert "comparing tensors" in err and "100%" in err, err[-2000:]


def test_small_checkpoints_show_no_bar(checkpoint_pair, tmp_path, capsys):
    checkpoint, reference = checkpoint_pair
    assert verify.verify(checkpoint, reference, None, tmp_path / "verify.json").passed
    assert "comparing tensors" not in capsys.readouterr().err
