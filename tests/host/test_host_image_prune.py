"""tests/host/container_image.py's prune_stale: what builds for other locks left is freed before a build,
what this lock's build reuses is kept (a stand-in engine: the real one is exercised by test_host_image.py)."""

from __future__ import annotations

from types import SimpleNamespace

import docker
import pytest

import container_image
from pipeline.host import image as image_stage


class StandInEngine:
    """The docker SDK calls prune_stale makes, over a list of tagged images."""

    def __init__(self, tags: list[str]):
        self.tags = list(tags)
        self.pruned = []
        self.images = SimpleNamespace(list=self._list, remove=self._remove, get=self._get, prune=self._prune)
        self.containers = SimpleNamespace(prune=lambda: self.pruned.append("containers"))

    def _list(self, name):
        return [SimpleNamespace(tags=[tag]) for tag in self.tags if tag.split(":")[0] == name]

    def _remove(self, tag, force):
        self.tags.remove(tag)

    def _get(self, tag):
        if tag not in self.tags:
            raise docker.errors.ImageNotFound(tag)

    def _prune(self, filters):
        self.pruned.append(filters)
        return {"ImagesDeleted": [{"Deleted": "sha256:1"}]}


def spec(wheelhouses, key: str) -> image_stage.BuildSpec:
    return image_stage.BuildSpec(base_image=container_image.BASE_TAG, lock=wheelhouses / "lock", tag=f"qwen3-pipeline:lock-{key}",
                                 wheelhouse=wheelhouses / key)


@pytest.fixture
def wheelhouses(tmp_path, monkeypatch):
    monkeypatch.setattr(container_image, "WHEELHOUSES", tmp_path)
    for key in ("aaaaaaaaaaaa", "bbbbbbbbbbbb"):
        (tmp_path / key).mkdir()
        (tmp_path / key / "torch.whl").write_bytes(b"x")
    (tmp_path / ".build.lock").write_text("")
    return tmp_path


def test_a_new_lock_frees_the_old_wheelhouse_image_and_install_stages(wheelhouses):
    engine = StandInEngine(["qwen3-pipeline:lock-aaaaaaaaaaaa", container_image.BASE_TAG, "127.0.0.1:5000/qwen3-pipeline:x"])
    removed = container_image.prune_stale(engine, spec(wheelhouses, "bbbbbbbbbbbb"))
    assert sorted(p.name for p in wheelhouses.iterdir()) == [".build.lock", "bbbbbbbbbbbb"]
    assert engine.tags == [container_image.BASE_TAG, "127.0.0.1:5000/qwen3-pipeline:x"]
    assert engine.pruned == ["containers", {"dangling": True}]
    assert "qwen3-pipeline:lock-aaaaaaaaaaaa" in removed and str(wheelhouses / "aaaaaaaaaaaa") in removed


def test_this_locks_image_and_its_cached_install_stage_are_kept(wheelhouses):
    engine = StandInEngine(["qwen3-pipeline:lock-bbbbbbbbbbbb", container_image.BASE_TAG])
    container_image.prune_stale(engine, spec(wheelhouses, "bbbbbbbbbbbb"))
    assert engine.tags == ["qwen3-pipeline:lock-bbbbbbbbbbbb", container_image.BASE_TAG]
    assert engine.pruned == [], "the untagged install stage this build reuses from cache was pruned"
