"""pipeline/stages/push.py against a real registry: Debian's docker-registry (the distribution registry)
on 127.0.0.1 and a private Docker engine (.ci/dockerd.sh). A tiny image (FROM scratch, one file) is pushed
with progress shown, its digest recorded and checked against the registry's manifest; then the local
copies are removed and it is pulled back by digest; the launch files name it by that digest."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import REPO, run_pipeline
from local_slurm import _free_ports

pytestmark = pytest.mark.slow  # starts a Docker engine and a registry, builds and pushes an image
LOCAL_TAG = "qwen3-pipeline-pushtest:lock-0123456789ab"


def _apt_install(*packages: str) -> str | None:
    if os.geteuid() != 0:
        return "not root"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            return f"`{' '.join(command)}` failed: {result.stderr.strip()[-300:]}"
    return None


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The Docker engine at DOCKER_HOST (CI's), else a private one started here (needs root)."""
    import docker

    if os.environ.get("DOCKER_HOST"):
        client = docker.from_env()
        client.ping()
        yield client, os.environ["DOCKER_HOST"]
        return
    if shutil.which("dockerd") is None:
        why = _apt_install("docker.io")
        if why or shutil.which("dockerd") is None:
            pytest.skip(f"no Docker engine: DOCKER_HOST unset and dockerd not installable ({why})")
    directory = Path("/tmp") / f"pushtest-dockerd-{os.getpid()}"  # short: the socket path has a length limit
    env = {**os.environ, "DOCKERD_DIR": str(directory)}
    started = subprocess.run(["bash", "-c", f"source {REPO}/.ci/dockerd.sh && dockerd_start && echo $DOCKER_HOST"],
                             env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    host = started.stdout.strip().splitlines()[-1]
    try:
        client = docker.DockerClient(base_url=host)
        client.ping()
        yield client, host
    finally:
        subprocess.run(["bash", "-c", f"source {REPO}/.ci/dockerd.sh && dockerd_stop"], env=env, timeout=120)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """docker-registry serving on 127.0.0.1:<free port>, storage in a temp dir; stopped by its PID."""
    binary = shutil.which("docker-registry")
    if binary is None:
        why = _apt_install("docker-registry")
        binary = shutil.which("docker-registry")
        if binary is None:
            pytest.skip(f"Debian's docker-registry is not installed and could not be ({why})")
    directory = tmp_path_factory.mktemp("registry")
    (port,) = _free_ports(1)
    config = directory / "config.yml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "version": 0.1, "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(directory / "data")}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}"}}))
    log = open(directory / "registry.log", "w")
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://{address}/v2/", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError((directory / "registry.log").read_text())
                time.sleep(0.2)
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def tiny_image(engine, tag: str):
    """An image made here, no base to pull: FROM scratch with one file."""
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        for name, data in (("Dockerfile", b"FROM scratch\nCOPY hello /hello\n"),
                           ("hello", f"push test {time.time()}\n".encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    context.seek(0)
    image, _ = engine.images.build(fileobj=context, custom_context=True, tag=tag, rm=True)
    return image


def manifest_digest(address: str, repo: str, tag: str) -> str:
    request = urllib.request.Request(f"http://{address}/v2/{repo}/manifests/{tag}", method="HEAD", headers={
        "Accept": "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json"})
    return urllib.request.urlopen(request, timeout=10).headers["Docker-Content-Digest"]


def test_push_records_the_digest_and_the_image_pulls_back_by_it(engine, registry, tmp_path, monkeypatch):
    engine, host = engine
    monkeypatch.setenv("DOCKER_HOST", host)
    built = tiny_image(engine, LOCAL_TAG)
    repo = f"{registry}/qwen3-pushtest"
    result = run_pipeline("push", "--registry", repo, "--image", LOCAL_TAG, root=tmp_path)
    out = result.stdout
    assert f"pushing {LOCAL_TAG} as {repo}:lock-0123456789ab" in out
    assert "Pushed" in out  # the per-layer progress
    (reference,) = [line.split()[1] for line in out.splitlines() if line.startswith("pushed ")]
    digest = manifest_digest(registry, "qwen3-pushtest", "lock-0123456789ab")
    assert reference == f"{repo}@{digest}"
    record = json.loads((tmp_path / "images.json").read_text())
    assert record[LOCAL_TAG] == {"reference": reference, "tag": f"{repo}:lock-0123456789ab"}

    # Gone from the engine, back by digest: the same image.
    engine.images.remove(LOCAL_TAG, force=True)
    engine.images.remove(f"{repo}:lock-0123456789ab", force=True)
    pulled = engine.images.pull(reference)
    assert pulled.id == built.id

    # The launch files pull exactly that reference when IMAGE names the local tag that was pushed.
    out_dir = tmp_path / "eks"
    run_pipeline("launch", "--scheduler", "eks", "--nodes", "2", "--model", "tiny", "--target", "cpu",
                 "--image", LOCAL_TAG, "--output", str(out_dir), root=tmp_path)
    assert f"image: {reference}" in (out_dir / "job.yaml").read_text()


def test_push_refuses_a_bad_registry_or_a_missing_image(engine, registry, tmp_path, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", engine[1])
    bad = run_pipeline("push", "--registry", "Qwen3 pipeline", root=tmp_path, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "is not <registry host>/<repository>" in bad.stderr
    missing = run_pipeline("push", "--registry", f"{registry}/x", "--image", "no-such-image:lock-0", root=tmp_path,
                           check=False)
    assert missing.returncode == 2 and "make image" in missing.stderr, missing.stderr
    assert not (tmp_path / "images.json").exists()
