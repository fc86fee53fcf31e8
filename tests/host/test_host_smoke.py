"""pipeline/host/smoke.py (`make smoke`): on CPU its CPU equivalents run for real (the op, a 2-rank gloo
all-reduce started by torchrun, the RoPE op's reference against torchtitan's CosSinRoPE at LNC=2) and
the output names what was skipped for lack of a device; on trn2 a missing device is a failure."""

from __future__ import annotations

import subprocess

import pytest

from helpers import REPO
from pipeline.host import smoke

pytestmark = pytest.mark.slow  # torchrun starts two ranks (~10 s on 2 cores)


def test_cpu_runs_the_cpu_equivalents_for_real_and_names_the_skips():
    result = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "pipeline", "smoke", "--target", "cpu"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("  ")}
    assert set(rows) == {"devices", "op", "all-reduce", "rope"}
    assert rows["devices"].split()[1] == "skipped"
    assert rows["op"].split()[1] == "pass" and "on the CPU" in rows["op"]
    # two real ranks over gloo: 1 + 2 on every element
    assert rows["all-reduce"].split()[1] == "pass" and "backend gloo, 2 ranks" in rows["all-reduce"]
    assert "sum [3.0] (expected 3)" in rows["all-reduce"]
    assert rows["rope"].split()[1] == "pass" and "S256" in rows["rope"] and "CosSinRoPE" in rows["rope"]  # 128 × LNC 2
    assert "SKIPPED for lack of a `neuron` device: the device count, the op on `neuron`, the 2-rank `neuron` " \
           "all-reduce and the rope_hf kernel at LNC=2" in result.stdout


def test_a_wrong_sum_fails_the_all_reduce_row():
    """What the row reads from rank 0: it fails when any element is not the sum."""
    record = {"backend": "gloo", "device": "cpu", "world": 2, "expected": 3.0}
    assert smoke.verdict({**record, "got": [3.0] * 8})[0] == smoke.PASS
    status, detail = smoke.verdict({**record, "got": [3.0] * 7 + [2.0]})
    assert status == smoke.FAIL and "sum [2.0, 3.0]" in detail


def test_trn2_without_devices_fails_instead_of_skipping(capsys):
    rows = smoke.run("trn2", 2)
    assert [(r.name, r.status) for r in rows] == [("devices", smoke.FAIL), ("op", smoke.FAIL),
                                                  ("all-reduce", smoke.FAIL), ("rope", smoke.FAIL)]
    assert "SKIPPED" not in smoke.table(rows, "trn2", 2)
    result = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "pipeline", "smoke", "--target", "trn2"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "smoke: devices, op, all-reduce, rope failed on trn2" in result.stderr
