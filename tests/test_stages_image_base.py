"""stages/image.py for the README's trn2 recipe: `make image` pulls a missing base image with progress
(instead of failing with "build it with make image first") and reaches the Neuron pip repository
without CI-only variables (issue 12, "The README's trn2 recipe, as written")."""

from __future__ import annotations

import argparse

import docker
import pytest

from conftest import REPO
from pipeline.errors import PipelineError
from pipeline.stages import image


class FakeImages:
    def __init__(self, present: set[str]):
        self.present = present

    def get(self, name):
        if name not in self.present:
            raise docker.errors.ImageNotFound(f"no such image: {name}")
        return type("Image", (), {"id": "sha256:1", "short_id": "1", "attrs": {"Size": 1}})()


class FakeApi:
    def __init__(self, engine, chunks):
        self.engine, self.chunks, self.pulled = engine, chunks, []

    def pull(self, name, stream=False, decode=False):
        assert stream and decode
        self.pulled.append(name)
        for chunk in self.chunks:
            yield chunk
        if not any("error" in c for c in self.chunks):
            self.engine.images.present.add(name)


class FakeEngine:
    def __init__(self, present=(), chunks=()):
        self.images = FakeImages(set(present))
        self.api = FakeApi(self, list(chunks))


BASE = "public.ecr.aws/neuron/pytorch-training-neuronx:2.14.0-neuronx-py314-sdk2.33.0-ubuntu26.04"


def test_missing_base_is_pulled_with_progress(capsys):
    engine = FakeEngine(chunks=[{"status": "Pulling from neuron/pytorch-training-neuronx", "id": "2.14.0"},
                                {"status": "Downloading", "id": "a1", "progress": "[=>   ] 10MB/2GB"},
                                {"status": "Pull complete", "id": "a1"},
                                {"status": "Digest: sha256:abc"}])
    image.ensure_base(engine, BASE)
    out = capsys.readouterr().out
    assert engine.api.pulled == [BASE]
    assert f"pulling the base image {BASE}" in out and "a1: Downloading [=>   ] 10MB/2GB" in out
    assert "a1: Pull complete" in out


def test_present_base_is_not_pulled():
    engine = FakeEngine(present={BASE})
    image.ensure_base(engine, BASE)
    assert engine.api.pulled == []


def test_a_failed_pull_is_one_line():
    engine = FakeEngine(chunks=[{"error": "pull access denied for nosuch/image"}])
    with pytest.raises(PipelineError, match="pulling nosuch/image:1 failed: pull access denied"):
        image.ensure_base(engine, "nosuch/image:1")


def test_build_pulls_the_base_before_the_wheelhouse(tmp_path, monkeypatch):
    lock = tmp_path / "requirements.lock"
    lock.write_text("torch==2.14.0\n")
    order = []
    engine = FakeEngine(chunks=[{"status": "Pull complete", "id": "a1"}])
    monkeypatch.setattr(image, "make_wheelhouse", lambda spec, eng: order.append(("wheelhouse", eng.api.pulled[:])))
    monkeypatch.setattr(image, "build_context", lambda spec, out: (_ for _ in ()).throw(RuntimeError("stop here")))
    spec = image.BuildSpec(base_image=BASE, lock=lock, tag="t", wheelhouse=tmp_path / "w")
    with pytest.raises(RuntimeError, match="stop here"):
        image.build(spec, engine)
    assert order == [("wheelhouse", [BASE])]


def test_neuron_pip_repository_without_ci_variables():
    env = image.pip_environment({"HOME": "/root"})
    assert "https://pip.repos.neuron.amazonaws.com" in env["PIP_EXTRA_INDEX_URL"]
    assert "https://download.pytorch.org/whl/cpu" in env["PIP_EXTRA_INDEX_URL"]
    # A user's own index setup wins.
    assert image.pip_environment({"PIP_EXTRA_INDEX_URL": "file:///mirror"}) == {"PIP_EXTRA_INDEX_URL": "file:///mirror"}
    assert "PIP_EXTRA_INDEX_URL" not in image.pip_environment({"PIP_NO_INDEX": "1"})


def test_workflow_needs_no_pip_variable():
    assert "PIP_EXTRA_INDEX_URL" not in (REPO / ".github" / "workflows" / "trn2.yml").read_text()


def test_build_spec_tags_and_keys_by_lock_and_base(tmp_path):
    lock = tmp_path / "l.lock"
    lock.write_text("torch==2.14.0\n")
    args = argparse.Namespace(lock=lock, base_image="local/base:1", tag=None, wheelhouse=None, python="python3",
                              pip_mount=[])
    spec = image.build_spec(args)
    assert spec.tag.endswith(spec.wheelhouse.name) and spec.wheelhouse.name != image.lock_sha256(lock)[:12]


def test_dockerfile_default_base_is_the_codes():
    import re

    from pipeline.run.image import DEFAULT_BASE_IMAGE

    (default,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", (REPO / "Dockerfile").read_text(), re.M)
    assert default == DEFAULT_BASE_IMAGE == image.DEFAULT_BASE_IMAGE
