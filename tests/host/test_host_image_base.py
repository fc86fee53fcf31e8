"""stages/image.py for the README's trn2 recipe: `make image` pulls a missing base image with progress
(instead of failing with "build it with make image first") and reaches the Neuron pip repository
without CI-only variables (issue 12, "The README's trn2 recipe, as written")."""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import tarfile
from pathlib import Path

import docker
import pytest

from helpers import REPO
from pipeline.errors import PipelineError
from pipeline.host import image
from pipeline.stages import image as image_stage


class FakeImages:
    def __init__(self, present: set[str]):
        self.present = present

    def get(self, name):
        if name not in self.present:
            raise docker.errors.ImageNotFound(f"no such image: {name}")
        repository = name.rsplit(":", 1)[0]
        digests = [f"{repository}@sha256:{'d' * 64}"] if name.startswith("public.ecr.aws/") else []
        return type("Image", (), {"id": "sha256:1", "short_id": "1", "attrs": {"Size": 1, "RepoDigests": digests}})()


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


def test_a_base_that_does_not_exist_says_how_to_look_it_up():
    """Issue 17, 2.3: the 2.33 DLC's repository name is unconfirmed; no silent guess."""
    engine = FakeEngine(chunks=[{"error": f"manifest for {BASE} not found: manifest unknown: Requested image not found"}])
    with pytest.raises(PipelineError) as err:
        image.ensure_base(engine, BASE)
    line = str(err.value)
    assert "\n" not in line and f"base image {BASE} (the default BASE_IMAGE, whose repository name" in line
    assert "does not exist: manifest for" in line
    assert "aws ecr-public describe-images" in line and "BASE_IMAGE=<repository>@sha256:<digest>" in line


def test_the_base_digest_is_what_the_engine_resolved():
    engine = FakeEngine(chunks=[{"status": "Pull complete", "id": "a1"}])
    base = image.ensure_base(engine, BASE)
    assert base.digest == "sha256:" + "d" * 64 and base.recorded_digest == base.digest
    local = image.ensure_base(FakeEngine(present={"local/base:1"}), "local/base:1")
    assert local.digest is None and local.recorded_digest == "sha256:1"  # made locally: its image id
    pinned = image.ensure_base(FakeEngine(present={"local/base@sha256:" + "e" * 64}), "local/base@sha256:" + "e" * 64)
    assert pinned.digest == "sha256:" + "e" * 64


def test_build_records_the_base_digest_in_the_image(tmp_path, monkeypatch):
    lock = tmp_path / "requirements.lock"
    lock.write_text("torch==2.14.0\n")
    engine = FakeEngine(present={BASE, "t"})
    built = {}

    def fake_build(**kwargs):
        built.update(kwargs["buildargs"])
        return iter([{"stream": "Successfully built 1\n"}])

    engine.api.build = fake_build
    monkeypatch.setattr(image, "make_wheelhouse", lambda spec, eng: spec.wheelhouse)
    monkeypatch.setattr(image, "context_files", lambda spec: [])
    result = image.build(image.BuildSpec(base_image=BASE, lock=lock, tag="t", wheelhouse=tmp_path / "w"), engine)
    assert built["BASE_DIGEST"] == "sha256:" + "d" * 64 == result["base_digest"] and built["BASE_IMAGE_ID"] == "sha256:1"
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'org.opencontainers.image.base.digest="${BASE_DIGEST}"' in dockerfile
    assert 'pipeline.base.id="${BASE_IMAGE_ID}"' in dockerfile


def test_the_context_is_streamed_as_a_tar_with_every_file(tmp_path):
    files = []
    for name, size in (("Dockerfile", 10), ("wheels/big.whl", 3 * 2**20 + 7), ("wheels/lock.txt", 0)):
        path = tmp_path / name.replace("/", "_")
        path.write_bytes(os.urandom(size))
        files.append((path, name))
    chunks = list(image.streamed_tar(files))
    assert len(chunks) > 1, "the context came as one piece: it was not streamed"
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
        assert tar.getnames() == [name for _, name in files]
        assert all(tar.extractfile(name).read() == path.read_bytes() for path, name in files)


def test_a_missing_context_file_fails_the_stream(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(image.streamed_tar([(tmp_path / "gone.whl", "wheels/gone.whl")]))


def test_an_engine_out_of_disk_is_named_with_the_fix(tmp_path, monkeypatch):
    lock = tmp_path / "requirements.lock"
    lock.write_text("torch==2.14.0\n")
    engine = FakeEngine(present={BASE, "t"})
    said = "Error processing tar file(exit status 1): write /wheels/torch.whl: no space left on device"

    def refused(**kwargs):
        list(kwargs["fileobj"])  # the engine read the context, then failed writing it
        raise docker.errors.APIError("500 Server Error", explanation=said)

    engine.api.build = refused
    monkeypatch.setattr(image, "make_wheelhouse", lambda spec, eng: spec.wheelhouse)
    monkeypatch.setattr(image, "context_files", lambda spec: [])
    with pytest.raises(PipelineError) as raised:
        image.build(image.BuildSpec(base_image=BASE, lock=lock, tag="t", wheelhouse=tmp_path / "w"), engine)
    assert said in str(raised.value) and "DockerRootDir" in raised.value.fix


def test_devices_owned_by_a_group_others_cannot_use_add_that_group(tmp_path):
    """Issue 17, 2.4: AWS's hardening leaves /dev/neuron* root:neuron 0660."""
    dev = tmp_path / "dev"
    (dev / "infiniband").mkdir(parents=True)
    for name, mode in (("neuron0", 0o660), ("neuron1", 0o660), ("infiniband/uverbs0", 0o666)):
        (dev / name).touch()
        os.chmod(dev / name, mode)
    neuron_gid = 4242
    for name in ("neuron0", "neuron1"):
        os.chown(dev / name, 0, neuron_gid) if os.geteuid() == 0 else None
    devices = image.host_devices(dev)
    assert [Path(d).relative_to(dev).as_posix() for d in devices] == ["neuron0", "neuron1", "infiniband/uverbs0"]
    expected = neuron_gid if os.geteuid() == 0 else os.getegid()
    assert image.device_groups(devices) == [expected]  # the world-usable uverbs device adds nothing
    os.chmod(dev / "neuron0", 0o666)
    os.chmod(dev / "neuron1", 0o666)
    assert image.device_groups(devices) == []


def test_containers_run_with_the_devices_group(tmp_path, monkeypatch):
    created = {}

    class Container:
        short_id = "c1"

        def start(self):
            pass

        def logs(self, **kwargs):
            return iter([b"ok\n"])

        def wait(self):
            return {"StatusCode": 0}

        def remove(self, force=False):
            pass

    class Containers:
        def create(self, image_name, command, **kwargs):
            created.update(kwargs)
            return Container()

    engine = type("Engine", (), {"containers": Containers()})()
    monkeypatch.setattr(image, "_writable_for_image_user", lambda directory: None)
    request = image.ContainerRun(image="img", argv=["doctor"], checkpoints=tmp_path / "c", hf_cache=tmp_path / "h",
                                 compile_cache=tmp_path / "cc", devices=["/dev/neuron0"], group_add=[4242])
    assert image.run_in_image(request, engine) == 0
    assert created["group_add"] == ["4242"] and created["devices"] == ["/dev/neuron0:/dev/neuron0:rwm"]
    # the host user's DCP digest key, so a run saved in a container resumes in the next one
    key = image.digest_key.key_path()
    folder = key.parent if os.geteuid() != 0 else key.parent / "image-user"  # root's container runs as the image's user
    assert created["volumes"][str(folder)] == {"bind": image.DIGEST_KEY_MOUNT, "mode": "rw"}
    assert folder.stat().st_uid == (os.geteuid() or image.IMAGE.uid) and folder.stat().st_mode & 0o077 == 0
    assert created["environment"]["PIPELINE_DIGEST_KEY"] == f"{image.DIGEST_KEY_MOUNT}/{key.name}"
    created.clear()
    assert image.run_in_image(dataclasses.replace(request, devices=[], group_add=[]), engine) == 0
    assert "group_add" not in created


def test_build_pulls_the_base_before_the_wheelhouse(tmp_path, monkeypatch):
    lock = tmp_path / "requirements.lock"
    lock.write_text("torch==2.14.0\n")
    order = []
    engine = FakeEngine(chunks=[{"status": "Pull complete", "id": "a1"}])
    monkeypatch.setattr(image, "make_wheelhouse", lambda spec, eng: order.append(("wheelhouse", eng.api.pulled[:])))
    monkeypatch.setattr(image, "context_files", lambda spec: (_ for _ in ()).throw(RuntimeError("stop here")))
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
    spec = image_stage.build_spec(args)
    assert spec.tag.endswith(spec.wheelhouse.name) and spec.wheelhouse.name != image.lock_sha256(lock)[:12]


def test_dockerfile_default_base_is_the_codes():
    """The Dockerfile's ARG default (a plain `docker build`) is configs/base-image.toml's reference; `make image`
    passes the code's default, that reference pinned by its digest once `make pin` recorded one."""
    import re
    import tomllib

    from pipeline.launch.image import DEFAULT_BASE_IMAGE

    (default,) = re.findall(r"^ARG BASE_IMAGE=(\S+)$", (REPO / "Dockerfile").read_text(), re.M)
    pin = tomllib.loads((REPO / "configs" / "base-image.toml").read_text())
    assert default == pin["reference"]
    assert DEFAULT_BASE_IMAGE == image.DEFAULT_BASE_IMAGE == (f"{default}@{pin['digest']}" if pin["digest"] else default)


def test_the_wheels_are_served_not_sent_and_on_a_port_fixed_per_wheelhouse(tmp_path):
    import urllib.request

    wheelhouse = tmp_path / "wh"
    wheelhouse.mkdir()
    (wheelhouse / "torch-2.14.1-py3-none-any.whl").write_bytes(b"wheel bytes")
    for name in image.WHEELHOUSE_RECORDS:
        (wheelhouse / name).write_text(name)
    spec = image.BuildSpec(base_image="b", lock=tmp_path / "lock", tag="t", wheelhouse=wheelhouse)
    sent = [name for _, name in image.context_files(spec) if name.startswith("wheels/")]
    assert sent == [f"wheels/{name}" for name in image.WHEELHOUSE_RECORDS], "a wheel went into the build context"
    # The install step's cache key holds WHEELS_URL: the same wheelhouse must get the same URL every build.
    assert image.wheel_port(wheelhouse) == image.wheel_port(tmp_path / "wh" / ".") != image.wheel_port(tmp_path)
    with image.served_wheels(wheelhouse) as url:
        assert url == f"http://127.0.0.1:{image.wheel_port(wheelhouse)}/"
        listing = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'href="torch-2.14.1-py3-none-any.whl"' in listing  # what pip's --find-links reads
        assert urllib.request.urlopen(url + "torch-2.14.1-py3-none-any.whl", timeout=10).read() == b"wheel bytes"
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)
