"""docker/wheelhouse.py and docker/make-wheelhouse.sh: what the image installs is derived from the
base image's own packages — the base keeps what it has, the lock adds what it lacks, every difference
is printed (issue 12, finding 4). A stand-in base (a local venv with some packages at other versions)
and a local wheel index replace the Neuron DLC and the network; no Docker engine involved."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import REPO

spec = importlib.util.spec_from_file_location("wheelhouse", REPO / "docker" / "wheelhouse.py")
wheelhouse = importlib.util.module_from_spec(spec)
sys.modules["wheelhouse"] = wheelhouse  # dataclasses look their module up by name
spec.loader.exec_module(wheelhouse)


def test_plan_keeps_the_base_and_adds_what_it_lacks():
    pins = wheelhouse.parse_lock("torch==2.14.0\ntorch-neuronx==2.14.3.0\ntransformers==5.16.0\n"
                                 "torchtitan @ git+https://github.com/aws-neuron/torchtitan-neuron@" + "a" * 40 + "\n"
                                 "tyro==1.0.17\n")
    base = {"torch": "2.14.0", "torch-neuronx": "2.14.3.1", "torchtitan": "0.2.2+neuron.1", "numpy": "2.3.0"}
    plan = wheelhouse.plan(pins, base)
    assert [p.name for p in plan.add] == ["transformers", "tyro"]
    assert [p.name for p in plan.same] == ["torch"]
    assert plan.differences() == [
        "torch-neuronx: lock 2.14.3.0, base image 2.14.3.1 (kept)",
        "torchtitan: lock git+https://github.com/aws-neuron/torchtitan-neuron@" + "a" * 40
        + ", base image 0.2.2+neuron.1 (kept)",
        "transformers: not in the base image, added at 5.16.0",
        "tyro: not in the base image, added at 1.0.17",
    ]


def test_core_packages_outside_the_lock_are_refused_naming_both_versions():
    """Issue 17, 2.2: the base keeps its versions, except for what the pipeline's code depends on."""
    commit = "a" * 40
    pins = wheelhouse.parse_lock(f"torch==2.14.0\ntorch-neuronx==2.14.3.0\ntransformers==5.16.0\nsafetensors==0.8.0\n"
                                 f"torchtitan @ git+https://github.com/aws-neuron/torchtitan-neuron@{commit}\n")
    core = frozenset({"torch", "transformers", "safetensors", "torchtitan"})
    base = {"torch": "2.14.0+cpu", "torch-neuronx": "2.14.4.0", "transformers": "4.57.1", "safetensors": "0.8.0",
            "torchtitan": "0.2.2+neuron.1"}
    result = wheelhouse.plan(pins, base, core, commit_of=lambda name: "b" * 40)
    assert result.refused == ["transformers: the base image has 4.57.1, the lock pins 5.16.0",
                              f"torchtitan: the base image has 0.2.2+neuron.1 at commit {'b' * 40}, "
                              f"the lock pins commit {commit}"]
    # torch 2.14.0+cpu is the pinned release (a local build label); torch-neuronx is not core: kept.
    assert [pin.name for pin, _ in result.kept] == ["torch", "torch-neuronx", "transformers", "torchtitan"]
    # An install from a clone records no commit: kept, not compared (doctor says so).
    assert wheelhouse.plan(pins, {**base, "transformers": "5.16.0"}, core, commit_of=lambda name: None).refused == []


def test_wildcards_are_not_a_pin():
    with pytest.raises(ValueError, match="wildcard"):
        wheelhouse.parse_lock("neuronx-cc==2.*\n")


def _wheel(directory: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": "Metadata-Version: 2.1\n" f"Name: {name}\nVersion: {version}\n"
                            + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(directory / f"{name}-{version}-py3-none-any.whl", "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A 'base image' Python with alpha 1.0 and beta 2.0, and an index with other versions and new packages."""
    root = tmp_path_factory.mktemp("wheelhouse")
    index = root / "index"
    index.mkdir()
    for name, version, requires in (("alpha", "1.0", ()), ("alpha", "1.1", ()), ("beta", "2.0", ()),
                                    ("gamma", "3.0", ("delta>=1", "alpha>=1.0")), ("delta", "1.0", ())):
        _wheel(index, name, version, requires)
    base = root / "base"
    subprocess.run([sys.executable, "-m", "venv", str(base)], check=True)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "CORE_PACKAGES": "beta,gamma"}  # the stand-in's "packages the code depends on"; alpha is not one
    subprocess.run([str(base / "bin" / "python"), "-m", "pip", "install", "-q", "alpha==1.0", "beta==2.0"], env=env,
                   check=True)
    return root, base / "bin" / "python", env


def test_make_wheelhouse_against_a_stand_in_base(stand_in):
    root, python, env = stand_in
    lock = root / "requirements.lock"
    lock.write_text("# stand-in lock\nalpha==1.1\nbeta==2.0\ngamma==3.0\n")
    out = root / "wheels"
    out.mkdir()
    result = subprocess.run(["/bin/sh", str(REPO / "docker" / "make-wheelhouse.sh"), str(python), str(lock), str(out)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    # Every difference is printed and recorded.
    assert "alpha: lock 1.1, base image 1.0 (kept)" in result.stdout
    assert "gamma: not in the base image, added at 3.0" in result.stdout
    assert (out / "differences.txt").read_text().splitlines() == [
        "alpha: lock 1.1, base image 1.0 (kept)", "gamma: not in the base image, added at 3.0"]
    # Only what the base lacks is installed (gamma and its new dependency delta), hash-checked.
    hashed = (out / "requirements.hashed.txt").read_text().splitlines()
    assert sorted(line.split(" ")[0] for line in hashed) == ["delta==1.0", "gamma==3.0"]
    assert all("--hash=sha256:" in line for line in hashed)
    image = dict(line.split("==") for line in (out / "image-packages.txt").read_text().splitlines())
    assert (image["alpha"], image["beta"], image["gamma"], image["delta"]) == ("1.0", "2.0", "3.0", "1.0")
    assert json.loads((out / "base-packages.json").read_text())


def test_a_lock_package_that_needs_another_base_version_fails_clearly(stand_in, tmp_path):
    root, python, env = stand_in
    _wheel(root / "index", "epsilon", "1.0", ("alpha==1.1",))
    lock = tmp_path / "requirements.lock"
    lock.write_text("epsilon==1.0\n")
    result = subprocess.run(["/bin/sh", str(REPO / "docker" / "make-wheelhouse.sh"), str(python), str(lock),
                             str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "alpha==1.1" in result.stdout + result.stderr  # pip names the conflict with the base's alpha 1.0
    assert not (tmp_path / "requirements.hashed.txt").exists()


def test_a_base_with_another_version_of_a_core_package_is_refused_in_one_line(stand_in, tmp_path):
    root, python, env = stand_in
    lock = tmp_path / "requirements.lock"
    lock.write_text("alpha==1.1\ngamma==3.0\n")
    result = subprocess.run(["/bin/sh", str(REPO / "docker" / "make-wheelhouse.sh"), str(python), str(lock),
                             str(tmp_path)], env={**env, "CORE_PACKAGES": "alpha,gamma"}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert (tmp_path / "refused.txt").read_text() == "alpha: the base image has 1.0, the lock pins 1.1\n"
    assert "error: alpha: the base image has 1.0, the lock pins 1.1" in result.stderr
    assert not (tmp_path / "requirements.hashed.txt").exists() and not list(tmp_path.glob("*.whl"))


def test_make_wheelhouse_needs_the_core_packages_named(stand_in, tmp_path):
    root, python, env = stand_in
    lock = tmp_path / "requirements.lock"
    lock.write_text("alpha==1.0\n")
    env = {k: v for k, v in env.items() if k != "CORE_PACKAGES"}
    result = subprocess.run(["/bin/sh", str(REPO / "docker" / "make-wheelhouse.sh"), str(python), str(lock),
                             str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "CORE_PACKAGES must name" in result.stderr
