"""pipeline/stages/doctor.py (`make doctor`) on a fake trn2 host tree and on this one."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.host import doctor
from pipeline.stages import doctor as doctor_stage
from helpers import REPO, run_pipeline, fake_trn2_host


def _row(rows, name):
    return next(r for r in rows if r.name == name)


def test_fake_trn2_host_is_recognised(tmp_path, monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    rows = doctor.checks("trn2", REPO / "requirements-dev.lock", host=fake_trn2_host(tmp_path))
    assert _row(rows, "Neuron devices").found == "16" and _row(rows, "Neuron devices").status == "ok"
    assert _row(rows, "Neuron driver").found == "2.31.7.0"
    assert _row(rows, "EFA").found.startswith("16 ")


def test_missing_devices_fail_only_for_trn2(tmp_path):
    host = doctor.Host(dev=tmp_path, sys=tmp_path, home=tmp_path)
    assert doctor.check_neuron_devices(host, "trn2").status == "FAIL"
    assert doctor.check_neuron_devices(host, "cpu").status == "warn"


def test_wrong_lnc_fails_on_trn2(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert doctor.check_lnc("trn2").status == "FAIL"


def test_package_pins_are_compared(tmp_path):
    lock = tmp_path / "x.lock"
    lock.write_text("# c\nPyYAML==0.0.1\npytest==%s\nno-such-package-xyz==1.0\nneuronx-cc==2.*\n" % __import__("pytest").__version__)
    rows = {r.name: r for r in doctor.check_packages(lock)}
    assert rows["python: PyYAML"].status == "FAIL" and rows["python: PyYAML"].needs == "0.0.1"
    assert rows["python: pytest"].status == "ok"
    assert rows["python: no-such-package-xyz"].found == "missing"


def test_token_value_never_printed(tmp_path, monkeypatch, capsys):
    secret = "hf_" + "s3cret" * 5
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(tmp_path))
    args = argparse.Namespace(target="cpu", lock=REPO / "requirements-dev.lock", all_packages=True)
    try:
        doctor_stage.run(args)
    except PipelineError:
        pass  # a FAIL row on this host is fine here; the printed table is what is checked
    out = capsys.readouterr().out
    assert "present (HF_TOKEN)" in out and secret not in out


def test_cli_table_and_status(tmp_path):
    result = run_pipeline("doctor", "--target", "cpu", root=tmp_path, check=False)
    assert "Neuron devices" in result.stdout and "Docker engine" in result.stdout and "Disk" in result.stdout
    assert "Python packages (requirements-dev.lock)" in result.stdout
    failed = "FAIL" in result.stdout
    assert result.returncode == (2 if failed else 0)
    trn2 = run_pipeline("doctor", "--target", "trn2", root=tmp_path, check=False)
    if not Path("/dev/neuron0").exists():
        assert trn2.returncode == 2 and "check(s) failed for target trn2" in trn2.stderr


def test_the_failure_count_equals_the_fail_rows_it_names(monkeypatch, capsys):
    rows = [doctor.Check(f"check {i}", "needed", "found", "FAIL" if i % 2 else "ok") for i in range(18)]
    monkeypatch.setattr(doctor_stage, "checks", lambda *a, **k: rows)
    args = argparse.Namespace(target="cpu", lock=Path("requirements-dev.lock"), all_packages=False)
    with pytest.raises(PipelineError) as err:
        doctor_stage.run(args)
    table = capsys.readouterr().out
    fail_rows = [line.split("  ")[0] for line in table.splitlines() if line.rstrip().endswith("FAIL")]
    count, names = re.match(r"(\d+) check\(s\) failed for target cpu: (.*)\.$", err.value.problem).groups()
    assert int(count) == len(fail_rows) == len(names.split(", ")) == 9
    assert names.split(", ") == fail_rows
