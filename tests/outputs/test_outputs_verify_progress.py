"""verify shows its progress: a tqdm bar over the checks where stderr is a terminal, and the table of the
checks once at the end (not a line per check and the table again); comparing a big checkpoint's tensors shows
a bar too; verify.json and the table stay; under `make pipeline` (PIPELINE_BRIEF=1) a passed verify is one line."""

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


def test_the_table_is_printed_once_and_a_terminal_shows_a_bar(checkpoint_pair, tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    checkpoint, reference = checkpoint_pair
    output = tmp_path / "verify.json"
    controller, terminal = pty.openpty()  # stderr a terminal, as a user's is (120 columns: tqdm fits its width)
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen([sys.executable, "-m", "pipeline", "verify", "--checkpoint", str(checkpoint),
                                "--reference", str(reference), "--output", str(output)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=terminal, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    os.close(terminal)
    seen = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        seen += chunk
    stdout, _ = process.communicate(timeout=300)
    os.close(controller)
    assert process.returncode == 0, stdout + seen.decode(errors="replace")
    lines = stdout.splitlines()
    recorded = json.loads(output.read_text())
    names = [c["name"] for c in recorded["checks"]]
    assert names[:5] == ["files", "load", "keys", "shapes", "dtypes"] and "step1-loss-export" in names
    for name in names:  # each check once, in the table
        assert len([line for line in lines if re.match(rf"  {re.escape(name)} +(pass|FAIL)  ", line)]) == 1, name
    assert sum(line.startswith("verify ") and " against " in line for line in lines) == 1
    assert lines[-1] == f"PASSED → {output}"
    bar = seen.decode(errors="replace")
    assert re.search(r"verify: \d+ checks", bar) and "step1-loss-export" in bar, bar[-2000:]


def test_under_make_pipeline_a_passed_verify_is_one_line(checkpoint_pair, tmp_path):
    checkpoint, reference = checkpoint_pair
    output = tmp_path / "verify.json"
    result = subprocess.run([sys.executable, "-m", "pipeline", "verify", "--checkpoint", str(checkpoint),
                             "--reference", str(reference), "--output", str(output)], cwd=REPO, capture_output=True,
                            text=True, env={**os.environ, "PIPELINE_BRIEF": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr
    recorded = json.loads(output.read_text())
    checks, export = len(recorded["checks"]), recorded["step1_loss"]["export"]
    assert result.stdout.splitlines() == [f"verify: PASSED {checks}/{checks} checks (step-1 loss: export {export:.6f}, "
                                          f"logged –, reference {export:.6f}) → {output}"]


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
