"""stages/doctor.py: doctor checks the environment the stages will really run in — the pipeline image
when they run there (IN_CONTAINER=1) — and passes on a correctly set-up trn2 host (issue 12,
finding 3: requirements.lock against a venv built from the dev lock always failed)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import docker
import pytest

from helpers import REPO, fake_trn2_host
from pipeline.launch.image import CORE_PACKAGES
from pipeline.host import doctor
from pipeline.titan import internals


def _image_record(tmp_path: Path, lock_names=("torch", "transformers", "safetensors")) -> tuple[Path, Path]:
    """A build record and lock as `make image` leaves them, for the packages of this venv (the stand-in image)."""
    record = tmp_path / "record"
    record.mkdir()
    lines = [f"{doctor._normalize(n)}=={metadata.version(n)}" for n in lock_names]
    (record / "image-packages.txt").write_text("\n".join(lines) + "\n")
    (record / "differences.txt").write_text("torch-neuronx: lock 0.0.0, base image 2.14.3.0 (kept)\n")
    # The packages the code depends on are at the lock's versions (else doctor fails the image, below);
    # every other package is kept at the base's version, whatever the lock says.
    lock = tmp_path / "requirements.lock"
    lock.write_text("".join(f"{n}=={metadata.version(n) if n in CORE_PACKAGES else '0.0.0'}\n" for n in lock_names))
    return record, lock


class FakeEngine:
    """An engine holding the image; running it runs the image's half of doctor here, against `record`."""

    def __init__(self, record, lock, present=True):
        self.present, self.record, self.lock, self.ran = present, record, lock, []
        self.images = SimpleNamespace(get=self._get)
        self.containers = SimpleNamespace(run=self._run)

    def _get(self, name):
        if not self.present:
            raise docker.errors.ImageNotFound(name)

    def _run(self, image, command, **kwargs):
        self.ran.append((image, command))
        target = command[command.index("--target") + 1]
        rows = doctor.inside_image_rows(target, record=self.record, lock=self.lock)
        return (json.dumps([asdict(r) for r in rows]) + "\n").encode()


@pytest.fixture
def trn2_host(tmp_path, monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(tmp_path / "ck"))
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda p: SimpleNamespace(free=500 * 2**30))
    monkeypatch.setattr(doctor, "check_docker", lambda needed=False: doctor.Check("Docker engine", "", "24.0", "ok"))
    return fake_trn2_host(tmp_path)


def _torchneuron_stand_in(tmp_path, monkeypatch):
    """The image's torch-neuronx, as importlib.metadata sees an installed distribution."""
    site = tmp_path / "site"
    info = site / "torch_neuronx-2.14.3.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-neuronx\nVersion: 2.14.3.0\n")
    monkeypatch.syspath_prepend(str(site))


def test_correct_trn2_host_running_stages_in_the_image_passes(trn2_host, tmp_path, monkeypatch):
    _torchneuron_stand_in(tmp_path, monkeypatch)
    record, lock = _image_record(tmp_path, ("torch", "torch-neuronx", "transformers", "safetensors"))
    engine = FakeEngine(record, lock)
    rows = doctor.checks("trn2", REPO / "requirements.lock", host=trn2_host, in_container=True, image="img:1",
                         engine=engine)
    assert [r for r in rows if r.status == "FAIL"] == []
    names = [r.name for r in rows]
    assert "Pipeline image" in names and "image: torchtitan internals" in names and "image: packages as built" in names
    assert engine.ran == [("img:1", ["doctor", "--inside-image", "--target", "trn2"])]
    # The host venv is compared with the lock it is built from, never with the image's requirements.lock.
    assert not any("requirements.lock" in r.name and "dev" not in r.name for r in rows if not r.name.startswith("image"))


def test_image_without_torchneuron_fails(trn2_host, tmp_path):
    record, lock = _image_record(tmp_path)
    rows = doctor.checks("trn2", REPO / "requirements.lock", host=trn2_host, in_container=True, image="img:1",
                         engine=FakeEngine(record, lock))
    (row,) = [r for r in rows if r.name == "image: torch-neuronx (stages in the image)"]
    assert row.status == "FAIL" and "Neuron PyTorch image" in row.found


def test_image_not_built_yet_is_a_warning(trn2_host, tmp_path):
    record, lock = _image_record(tmp_path)
    rows = doctor.checks("trn2", REPO / "requirements.lock", host=trn2_host, in_container=True, image="img:1",
                         engine=FakeEngine(record, lock, present=False))
    (row,) = [r for r in rows if r.name == "Pipeline image"]
    assert row.status == "warn" and "make image" in row.found
    assert [r for r in rows if r.status == "FAIL"] == []


def test_stages_on_a_host_venv_without_torchneuron_fail_naming_the_fix(trn2_host):
    rows = doctor.checks("trn2", REPO / "requirements.lock", host=trn2_host)
    (row,) = [r for r in rows if r.name.startswith("torch-neuronx")]
    assert row.status == "FAIL" and "IN_CONTAINER=1" in row.found


def test_image_that_drifted_from_its_record_fails(tmp_path):
    record, lock = _image_record(tmp_path)
    (record / "image-packages.txt").write_text("transformers==0.0.1\n")
    rows = {r.name: r for r in doctor.inside_image_rows("cpu", record=record, lock=lock)}
    assert rows["packages as built"].status == "FAIL" and "transformers" in rows["packages as built"].found
    assert rows["lock packages"].status == "ok"
    assert "at the base image's version" in rows["lock packages"].found


def test_the_image_is_checked_against_the_lock_it_was_built_from(tmp_path):
    record, lock = _image_record(tmp_path)
    (record / "lock.txt").write_text("transformers==0.0.0\nno-such-package-xyz==1.0\n")
    rows = {r.name: r for r in doctor.inside_image_rows("cpu", record=record)}
    assert rows["lock packages"].status == "FAIL" and "absent: no-such-package-xyz" in rows["lock packages"].found
    assert str(record / "lock.txt") in rows["lock packages"].needs


def test_image_with_another_torchtitan_fails(tmp_path, monkeypatch):
    record, lock = _image_record(tmp_path)
    gone = internals.TitanName("torchtitan.models.qwen3", "_no_such_builder", "test")
    monkeypatch.setattr(internals, "internals_for", lambda target: internals.TORCHTITAN_INTERNALS + (gone,))
    rows = {r.name: r for r in doctor.inside_image_rows("trn2", record=record, lock=lock)}
    assert rows["torchtitan internals"].status == "FAIL" and "_no_such_builder" in rows["torchtitan internals"].found


def test_make_doctor_passes_in_container(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k not in ("IN_CONTAINER", "IMAGE")}
    out = subprocess.run(["make", "-n", "--no-print-directory", "doctor", "IN_CONTAINER=1", "IMAGE=reg/q:1"], cwd=REPO,
                         capture_output=True, text=True, env=env, check=True).stdout
    assert "--in-container --image 'reg/q:1'" in out  # each value one single-quoted word
    out = subprocess.run(["make", "-n", "--no-print-directory", "doctor"], cwd=REPO, capture_output=True, text=True,
                         env=env, check=True).stdout
    assert "--in-container" not in out  # no /dev/neuron0 here: the stages run in this venv


def _make_n(target: str, *args: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("IN_CONTAINER", "IMAGE", "HAS_NEURON")}
    return subprocess.run(["make", "-n", "--no-print-directory", target, *args], cwd=REPO, capture_output=True,
                          text=True, env={**clean, **env}, check=True).stdout


def test_on_a_neuron_host_stages_run_in_the_image_unless_the_venv_has_torchneuron(tmp_path):
    """README trn2 recipe: on a fresh trn2 host (`make setup`'s venv has no Neuron packages) every stage
    runs in the image without IN_CONTAINER being set; a venv with torch_neuronx runs them itself."""
    neuron = {"HAS_NEURON": "/dev/neuron0"}
    in_image = _make_n("train-native", "DRY_RUN=1", **neuron)
    assert " -m pipeline image  --run train " in in_image and " --path 'native' " in in_image
    assert "--in-container" in _make_n("doctor", **neuron)
    venv = tmp_path / "neuron-venv"
    (venv / "lib" / "python3.14" / "site-packages" / "torch_neuronx").mkdir(parents=True)
    (venv / "bin").mkdir()
    (venv / "bin" / "python").touch()
    out = _make_n("train-native", "DRY_RUN=1", f"VENV={venv}", **neuron)
    assert " -m pipeline image" not in out and f"'{venv}/bin/python' -m pipeline train" in out
    assert " -m pipeline image" not in _make_n("train-native", "DRY_RUN=1")  # no Neuron device here


def test_image_whose_base_has_another_version_of_a_core_package_fails_naming_both(tmp_path):
    """Issue 17, 2.2: the base's versions are kept, but not for what the code depends on."""
    record, lock = _image_record(tmp_path, ("torch", "tqdm", "transformers"))
    lock.write_text(lock.read_text().replace(f"transformers=={metadata.version('transformers')}", "transformers==4.0.0"))
    rows = {r.name: r for r in doctor.inside_image_rows("cpu", record=record, lock=lock)}
    row = rows["code depends on: transformers"]
    assert row.status == "FAIL" and row.needs == "lock 4.0.0" and row.found == metadata.version("transformers")
    assert rows["code depends on: torch"].status == "ok"
    assert "code depends on: tqdm" not in rows  # kept at the base's version, not compared


def test_core_package_pinned_to_a_commit_is_compared_by_the_commit_its_install_recorded(tmp_path):
    lock = tmp_path / "requirements.lock"
    lock.write_text("torchtitan @ git+https://github.com/aws-neuron/torchtitan-neuron@" + "a" * 40 + "\n")
    installed = {"torchtitan": "0.2.2+neuron.1"}
    (row,) = doctor.core_package_rows(lock, installed, commit_of=lambda name: "b" * 40)
    assert row.status == "FAIL" and row.found == "0.2.2+neuron.1 at commit " + "b" * 40 and "a" * 40 in row.needs
    (row,) = doctor.core_package_rows(lock, installed, commit_of=lambda name: "a" * 40)
    assert row.status == "ok"
    (row,) = doctor.core_package_rows(lock, installed, commit_of=lambda name: None)  # `pip install -e .` of a clone
    assert row.status == "warn" and "not compared" in row.found
