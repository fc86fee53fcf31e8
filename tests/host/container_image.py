"""The container tests' image, made here so that `.ci/run` can also build it in the background while
the tests before the container tests run (`python -m tests.host.container_image`): the tests' own build
then waits for that one (a file lock) and finds every layer and the wheelhouse cached.

No registry is reachable here, so the base is a Debian bookworm (Python 3.11, like the CPU wheels, plus
g++ and Python headers for inductor) made with mmdebstrap and imported. The test image is the same
Dockerfile with requirements-dev.lock minus the test runner: torch 2.14.1's CUDA build and its NVIDIA
wheels are heavy (a 3.1 GB wheelhouse, a 6.3 GiB image, measured 2026-11-30), but the only CPU build on
local disk, torch 2.13.0+cpu, cannot run torchtitan 0.3.0 (its FSDP needs torch 2.14: "When dp_mesh_dims
is provided, all parameters must be DTensors"). The wheelhouse is made inside that base by the same code
`make image` uses, from the local pip indexes mounted in.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline import envvars
from pipeline.host import image as image_stage
from pipeline.launch.image import IMAGE_REPO, default_tag, lock_sha256

REPO = Path(__file__).resolve().parents[2]

# torchtitan compiles its flex-attention block mask with torch.compile even when the model runs
# eagerly, so inductor needs a C++ compiler and Python headers in the image, as on the host.
BASE_TAG = "local/debian-py311-gxx:bookworm"
# triton and the NVIDIA wheels stay: torchtitan 0.3.0 imports triton, torch's CUDA build loads cudart.
NOT_IN_CPU_IMAGE = re.compile(r"^(pytest==|iniconfig==|pluggy==)", re.I)
# This machine's pip setup (`pip config list`): PyPI plus local file indexes and CA certificates.
PIP_MOUNTS = tuple(p for p in ("/opt/pypi", "/opt/pypi-more", "/opt/wheels", "/etc/ssl/certs") if Path(p).is_dir())
PIP_ENV = {"PIP_EXTRA_INDEX_URL": "file:///opt/pypi/simple file:///opt/pypi-more/simple", "PIP_FIND_LINKS": "/opt/wheels",
           "PIP_CERT": "/etc/ssl/certs/ca-certificates.crt", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
MEASURE = Path(os.environ.get(envvars.MEASURE_DIR, "/tmp")) / "container-measurements.json"
WHEELHOUSES = Path("/tmp/pipeline-wheelhouse")  # keyed by the lock's hash and kept between sessions: the slow part
LOCK_WAIT_S = 2700  # a build holding the lock longer than CI's budget for it is stuck


@contextlib.contextmanager
def build_lock():
    """One builder of the base and the image at a time (the background build and the tests' own)."""
    WHEELHOUSES.mkdir(parents=True, exist_ok=True)
    with open(WHEELHOUSES / ".build.lock", "w") as handle:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another build held {handle.name} for {LOCK_WAIT_S} s") from None
                time.sleep(2)
        yield


def base_image(engine, workdir: Path) -> str:
    """The local Debian base, imported once per engine."""
    import docker

    with build_lock():
        try:
            engine.images.get(BASE_TAG)
            return BASE_TAG
        except docker.errors.ImageNotFound:
            pass
        assert shutil.which("mmdebstrap"), "mmdebstrap is needed to make the local base: apt-get install -y mmdebstrap"
        rootfs = Path(workdir) / "rootfs.tar"
        subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--include=python3,python3-venv,python3-dev,g++",
                        "bookworm", str(rootfs)], check=True, timeout=900)
        engine.api.import_image_from_file(str(rootfs), repository=BASE_TAG.split(":")[0], tag=BASE_TAG.split(":")[1])
        rootfs.unlink()
        return BASE_TAG


def cpu_lock(workdir: Path) -> Path:
    lines = [line for line in (REPO / "requirements-dev.lock").read_text().splitlines()
             if line.strip() and not line.startswith("#") and not NOT_IN_CPU_IMAGE.match(line)]
    assert any(line.startswith("torch==") for line in lines), "requirements-dev.lock no longer pins torch"
    lock = Path(workdir) / "requirements-cpu-test.lock"
    lock.write_text("# requirements-dev.lock for a CPU test image (tests/host/test_host_image.py)\n" + "\n".join(lines) + "\n")
    return lock


def prune_stale(engine, spec: image_stage.BuildSpec) -> list[str]:
    """Free what builds for other locks left: their wheelhouses (3.1 GB each), test images (6.3 GiB each) and,
    when this lock's image is not built yet, the untagged layers of earlier builds (the two-stage build's
    install stages, interrupted builds) and stopped containers. CI machines keep /tmp (and this engine's data-root in it) between runs, so without this every lock
    change left ~10 GB behind until a run found its disk full. Returns what it removed."""
    import docker

    removed = [str(old) for old in WHEELHOUSES.iterdir() if old.is_dir() and old != spec.wheelhouse]
    for old in removed:
        shutil.rmtree(old, ignore_errors=True)
    for stale in engine.images.list(name=IMAGE_REPO):
        for tag in stale.tags:
            if tag.split(":", 1)[0] == IMAGE_REPO and tag != spec.tag:
                engine.images.remove(tag, force=True)
                removed.append(tag)
    try:
        engine.images.get(spec.tag)
    except docker.errors.ImageNotFound:
        engine.containers.prune()
        pruned = engine.images.prune(filters={"dangling": True}).get("ImagesDeleted") or []
        removed += [f"{len(pruned)} untagged image layer(s)"] if pruned else []
    return removed


def build(engine, base: str, lock: Path) -> dict:
    spec = image_stage.BuildSpec(base_image=base, lock=lock, tag=default_tag(lock),
                                 wheelhouse=WHEELHOUSES / lock_sha256(lock)[:12], pip_mounts=PIP_MOUNTS)
    os.environ.update(PIP_ENV)
    with build_lock():
        removed = prune_stale(engine, spec)
        if removed:
            print(f"freed what earlier builds left: {', '.join(removed)}", flush=True)
        built = image_stage.build(spec, engine)
    MEASURE.write_text(json.dumps({"build_seconds": built["seconds"], "image_bytes": built["size_bytes"],
                                   "tag": built["tag"]}, indent=2))
    return built


def main() -> int:
    """The background build of .ci/run, on the engine at DOCKER_HOST."""
    import docker

    engine = docker.from_env(timeout=600)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as workdir:
        built = build(engine, base_image(engine, Path(workdir)), cpu_lock(Path(workdir)))
    print(f"container test image {built['tag']} built in the background in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
