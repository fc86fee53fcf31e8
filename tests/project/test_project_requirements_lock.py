"""requirements.lock and launch/image.py: no wildcard pins, torchtitan-neuron named as pip sees it and
pinned to a commit (a placeholder refused by `make image` with a clear message), so the image tag made
from the lock's hash means one set of packages (issue 12, finding 5)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from helpers import REPO
from pipeline.errors import PipelineError
from pipeline.launch import image

LOCK = REPO / "requirements.lock"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _lines():
    return [line for line in LOCK.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_every_pin_is_one_version_or_one_commit():
    for line in _lines():
        req = Requirement(line)
        if req.url:
            assert req.url.endswith("@COMMIT-UNKNOWN") or image.COMMIT.search(req.url), line
        else:
            (spec,) = req.specifier
            assert spec.operator == "==" and "*" not in spec.version, line


def test_torchtitan_neuron_is_named_as_pip_sees_it():
    (line,) = [line for line in _lines() if "torchtitan-neuron" in line]
    req = Requirement(line)
    assert req.name == "torchtitan"  # installed from a clone, imported and listed by pip as torchtitan
    assert req.url.startswith("git+https://github.com/aws-neuron/torchtitan-neuron@")
    assert not any(Requirement(x).name == "torchtitan-neuron" for x in _lines())


def test_neuron_versions_are_the_2_33_release():
    pins = {Requirement(x).name: str(Requirement(x).specifier) for x in _lines() if "@" not in x}
    assert pins["torch"] == "==2.14.0" and pins["torch-neuronx"] == "==2.14.3.0"
    assert pins["neuronx-cc"] == "==2.28.7631.0" and pins["nki"] == "==0.7.0"


def test_placeholder_and_wildcards_are_refused(tmp_path):
    with pytest.raises(PipelineError, match="COMMIT-UNKNOWN.*not a 40-hex commit"):
        image.check_lock(LOCK)
    pinned = tmp_path / "pinned.lock"
    pinned.write_text(LOCK.read_text().replace("COMMIT-UNKNOWN", COMMIT))
    assert len(image.check_lock(pinned)) == len(_lines())
    for bad in ("neuronx-cc==2.*\n", "torch>=2.14\n", "torchtitan @ git+https://github.com/x/y@release-2.33\n"):
        (tmp_path / "bad.lock").write_text(bad)
        with pytest.raises(PipelineError):
            image.check_lock(tmp_path / "bad.lock")


def test_make_image_refuses_the_placeholder_before_docker(tmp_path):
    """`python -m pipeline image` (what `make image` runs) stops on the lock, not on a missing engine."""
    env = {**os.environ, "DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock", "PIPELINE_CHECKPOINTS": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "pipeline", "image"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "torchtitan is pinned to 'COMMIT-UNKNOWN'" in line and "git ls-remote" in line
    assert not (REPO / "build" / "wheelhouse").exists() or not any((REPO / "build" / "wheelhouse").iterdir())


def test_one_tag_one_set_of_packages(tmp_path):
    lock = tmp_path / "a.lock"
    lock.write_text(f"torch==2.14.0\ntorchtitan @ git+https://github.com/aws-neuron/torchtitan-neuron@{COMMIT}\n")
    default = image.default_tag(lock)
    assert default == f"qwen3-pipeline:lock-{image.lock_sha256(lock)[:12]}" == image.default_tag(lock, image.DEFAULT_BASE_IMAGE)
    # The image keeps the base's own versions, so another base is another set of packages: another tag.
    assert image.default_tag(lock, "local/other-base:1") != default
    lock.write_text(lock.read_text().replace(COMMIT, "f" * 40))
    assert image.default_tag(lock) != default
