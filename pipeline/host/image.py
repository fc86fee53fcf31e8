"""Build the container image, and run any stage inside it — both through the Docker SDK.

`python -m pipeline image` builds: a wheelhouse made inside the base image (so wheels match
its Python), then the Dockerfile with build progress streamed. The tag comes from the lock's
hash, so a changed lock is a new image. `python -m pipeline image --run <stage> <args…>` runs
`python -m pipeline <stage> <args…>` in that image with every /dev/neuron* device, checkpoints/,
the HF cache and the Neuron compile cache bind-mounted, HF_TOKEN passed through, logs streamed
and the exit status returned; the container is removed on success, failure or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import envvars
from pipeline.errors import PipelineError
from pipeline.run import digest_key, store, targets
from pipeline.launch.image import IMAGE, CORE_PACKAGES, DEFAULT_BASE_IMAGE, check_lock, lock_sha256

# Where pip inside the base image finds what the lock adds (a user's PIP_INDEX_URL/PIP_EXTRA_INDEX_URL
# wins): PyPI, then AWS's Neuron pip repository and PyTorch's CPU wheel index, as AWS's TorchNeuron
# install pages give them (setup/pytorch/update-manual, 2.33). No CI-only variable is needed.
NEURON_PIP_INDEXES = "https://pip.repos.neuron.amazonaws.com https://download.pytorch.org/whl/cpu"
# What a stage in the image reads from the caller's environment (values never printed).
DIGEST_KEY_MOUNT = "/digest-key"  # where the container sees the folder of the host user's DCP digest key
PASSED_THROUGH = (envvars.HF_TOKEN, "HF_HUB_OFFLINE", "HF_ENDPOINT", envvars.TARGET, envvars.REQUIRE_PINNED, envvars.VERBOSE,
                  envvars.BRIEF)
WHEELHOUSE_RECORDS = ("requirements.hashed.txt", "image-packages.txt", "differences.txt", "lock.txt")


@dataclass(frozen=True)
class BuildSpec:
    base_image: str
    lock: Path
    tag: str
    wheelhouse: Path
    python: str = "python3"
    # Host directories the wheelhouse container sees at the same path (a local pip index, say).
    pip_mounts: tuple[str, ...] = ()


@dataclass(frozen=True)
class ContainerRun:
    image: str
    argv: list[str]
    checkpoints: Path
    hf_cache: Path
    compile_cache: Path
    devices: list[str] = field(default_factory=list)
    # Supplementary groups of the container user: those owning devices it could not open otherwise.
    group_add: list[int] = field(default_factory=list)
    network_host: bool = True
    hub_cache: Path | None = None  # HF_HUB_CACHE when the user set one apart from HF_HOME
    shm_size: str = "8g"


def client():
    """A pinged Docker client, or a one-line error naming DOCKER_HOST."""
    import docker

    try:
        engine = docker.from_env(timeout=600)
        engine.ping()
        return engine
    except Exception as err:  # any failure to reach the engine is the same user problem
        where = os.environ.get("DOCKER_HOST", "the default socket /var/run/docker.sock")
        raise PipelineError(f"no Docker engine answers at {where} ({type(err).__name__}).",
                            "start dockerd (e.g. `.ci/dockerd.sh start`) and export DOCKER_HOST.") from err


def pip_environment(environ: dict) -> dict:
    """The PIP_* variables the wheelhouse container gets: the caller's, with the Neuron and PyTorch CPU
    indexes added unless the caller chose its own."""
    pip_env = {k: v for k, v in environ.items() if k.startswith("PIP_")}
    if not any(k in pip_env for k in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX")):
        pip_env["PIP_EXTRA_INDEX_URL"] = NEURON_PIP_INDEXES
    return pip_env


# How to find the base when it does not exist. The 2.33 TorchNeuron DLC's repository name is in no source
# read for this project (docs/trn2.md); AWS's list of Neuron DLCs (awsdocs-neuron v2.33.0,
# deploy/environments/dlc-images, "Neuron Deep Learning Containers") sends readers to
# github.com/aws-neuron/deep-learning-containers "for the exact published tags".
LOOK_UP_BASE = ("find the Neuron 2.33 \"PyTorch Training (TorchNeuron)\" DLC's repository and tag in "
                "github.com/aws-neuron/deep-learning-containers (linked from AWS's Neuron DLC list, "
                "awsdocs-neuron deploy/environments/dlc-images), or with `aws ecr-public describe-images --region "
                "us-east-1 --repository-name neuron/<name>`, then pass BASE_IMAGE=<repository>@sha256:<digest>.")
# What a registry says when the name or tag is not there (Docker's pull errors, by registry).
NOT_FOUND = ("not found", "manifest unknown", "does not exist", "repository name not known", "name unknown")


@dataclass(frozen=True)
class BaseImage:
    """The base as the engine resolved it: what the image records about where it came from."""

    name: str
    image_id: str  # the local image id (sha256 of its config)
    digest: str | None  # the registry's manifest digest, None for a base made locally

    @property
    def recorded_digest(self) -> str:
        return self.digest or self.image_id


def _base_missing(base_image: str, reason: str) -> PipelineError:
    unconfirmed = (" (the default BASE_IMAGE, whose repository name no source read for this project confirms)"
                   if base_image == DEFAULT_BASE_IMAGE else "")
    return PipelineError(f"base image {base_image}{unconfirmed} does not exist: {reason}", LOOK_UP_BASE)


def _pull_failed(base_image: str, reason: str) -> PipelineError:
    if any(marker in reason.lower() for marker in NOT_FOUND):
        return _base_missing(base_image, reason)
    return PipelineError(f"pulling {base_image} failed: {reason}",
                         "check the network and registry login (or pass BASE_IMAGE=).")


def ensure_base(engine, base_image: str) -> BaseImage:
    """Inspect the base, pulling it (with the registry's progress) when the engine lacks it; its digest."""
    import docker

    try:
        return _resolved(base_image, engine.images.get(base_image))
    except docker.errors.ImageNotFound:
        pass
    print(f"pulling the base image {base_image} (not in the engine yet; several GB the first time) …", flush=True)
    last: dict[str, str] = {}
    shown = 0.0
    try:
        for chunk in engine.api.pull(base_image, stream=True, decode=True):
            if "error" in chunk:
                raise _pull_failed(base_image, chunk["error"].strip())
            layer, status = chunk.get("id", ""), chunk.get("status", "")
            if last.get(layer) != status or (chunk.get("progress") and time.monotonic() - shown > 5):
                last[layer] = status
                shown = time.monotonic()
                print(f"  {layer + ': ' if layer else ''}{status} {chunk.get('progress', '')}".rstrip(), flush=True)
    except docker.errors.APIError as err:
        raise _pull_failed(base_image, str(err.explanation or err).strip()) from err
    try:
        return _resolved(base_image, engine.images.get(base_image))
    except docker.errors.ImageNotFound as err:
        raise _base_missing(base_image, "the pull finished without it") from err


def _resolved(base_image: str, found) -> BaseImage:
    """The digest of the repository the name refers to, when the engine has it from a registry."""
    repository = base_image.split("@", 1)[0]
    if ":" in repository.rsplit("/", 1)[-1]:
        repository = repository.rsplit(":", 1)[0]
    digests = found.attrs.get("RepoDigests") or []
    digest = next((d.split("@", 1)[1] for d in digests if d.split("@", 1)[0] == repository), None)
    if "@" in base_image:
        digest = base_image.split("@", 1)[1]  # pinned by digest: that is what it is
    return BaseImage(base_image, found.id, digest)


def make_wheelhouse(spec: BuildSpec, engine) -> Path:
    """Wheels for the lock, made by pip inside the base image; the hashed list the Dockerfile installs."""
    hashed = spec.wheelhouse / "requirements.hashed.txt"
    if all((spec.wheelhouse / name).exists() for name in WHEELHOUSE_RECORDS):
        return spec.wheelhouse  # complete: made by this code for this lock and base
    spec.wheelhouse.mkdir(parents=True, exist_ok=True)
    refused = spec.wheelhouse / "refused.txt"
    refused.unlink(missing_ok=True)
    pip_env = {**pip_environment(dict(os.environ)), "CORE_PACKAGES": ",".join(CORE_PACKAGES)}
    volumes = {str(spec.wheelhouse.resolve()): {"bind": "/wheels", "mode": "rw"},
               str(spec.lock.resolve()): {"bind": "/lock/requirements.lock", "mode": "ro"},
               str(store.REPO / "docker"): {"bind": "/pipeline-docker", "mode": "ro"}}
    volumes.update({m: {"bind": m, "mode": "ro"} for m in spec.pip_mounts})
    print(f"making the wheelhouse {spec.wheelhouse} inside {spec.base_image}", flush=True)
    code = stream_container(engine, spec.base_image, ["/bin/sh", "/pipeline-docker/make-wheelhouse.sh", spec.python,
                                                      "/lock/requirements.lock"],
                            volumes=volumes, environment=pip_env, user="0", network_mode="host")
    if code != 0 or not hashed.exists():
        hashed.unlink(missing_ok=True)
        if refused.exists():
            raise PipelineError(f"base image {spec.base_image} has other versions of packages the pipeline's code "
                                f"depends on: {refused.read_text().strip()}.",
                                "build on a base with the lock's versions, or change requirements.lock to the "
                                "base's versions and run the tests on them.")
        raise PipelineError(f"making the wheelhouse in {spec.base_image} failed (status {code}).",
                            "read pip's error above; the base image needs a Python with pip, and network or "
                            "--pip-mount'ed indexes.")
    return spec.wheelhouse


def context_files(spec: BuildSpec) -> list[tuple[Path, str]]:
    """(file, name in the context): the repo filtered by .dockerignore, plus the wheelhouse's records as wheels/
    (the wheels themselves are served: served_wheels)."""
    from docker.utils.build import exclude_paths

    patterns = [p for p in (store.REPO / ".dockerignore").read_text().splitlines() if p.strip() and p[0] != "#"]
    included = sorted(exclude_paths(str(store.REPO), patterns, dockerfile="Dockerfile"))
    files = [(store.REPO / rel, rel) for rel in included
             if (store.REPO / rel).is_file() and not rel.startswith("wheels/")]
    files += [(spec.wheelhouse / name, f"wheels/{name}") for name in WHEELHOUSE_RECORDS]
    return files


def wheel_port(wheelhouse: Path) -> int:
    """The loopback port the wheelhouse is served on: fixed per wheelhouse, because WHEELS_URL is part of the
    install step's cache key (a new port would reinstall the multi-GB venv on every build)."""
    return 20000 + int(hashlib.sha256(str(wheelhouse.resolve()).encode()).hexdigest()[:8], 16) % 20000


@contextlib.contextmanager
def served_wheels(wheelhouse: Path) -> Iterator[str]:
    """The wheelhouse as a pip --find-links URL on the host's loopback, while the build runs."""
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:  # pip's own output says what it fetched
            pass

    handler = partial(Quiet, directory=str(wheelhouse))
    try:
        server = ThreadingHTTPServer(("127.0.0.1", wheel_port(wheelhouse)), handler)
    except OSError:  # the port is taken: any free one works, at the cost of the install step's cache
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        print(f"port {wheel_port(wheelhouse)} is in use: the wheelhouse is served on {server.server_port}, so the "
              "venv step is not taken from the build cache", flush=True)
    thread = threading.Thread(target=server.serve_forever, name="wheelhouse", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()


def streamed_tar(files: list[tuple[Path, str]]) -> Iterator[bytes]:
    """The files as one tar, made while the engine reads it. A CUDA-torch wheelhouse is GBs: written to
    a file first, it took that much more disk, and on a nearly full one the engine's own copy of the
    context then failed ("no space left on device")."""
    read_fd, write_fd = os.pipe()
    failure: list[BaseException] = []

    def write() -> None:
        try:
            with os.fdopen(write_fd, "wb") as sink, tarfile.open(fileobj=sink, mode="w|") as tar:
                for path, name in files:
                    tar.add(path, arcname=name, recursive=False)
        except BrokenPipeError:
            pass  # the reader stopped (the engine refused the build): its error is the one reported
        except BaseException as err:  # noqa: BLE001 - handed to the reading side, which raises it
            failure.append(err)

    writer = threading.Thread(target=write, name="build-context", daemon=True)
    writer.start()
    with os.fdopen(read_fd, "rb") as source:
        while chunk := source.read(1 << 20):
            yield chunk
    writer.join()
    if failure:
        raise failure[0]


def build(spec: BuildSpec, engine=None) -> dict:
    import docker

    check_lock(spec.lock)  # a placeholder or wildcard pin is refused before anything is pulled or built
    engine = engine or client()
    started = time.monotonic()
    base = ensure_base(engine, spec.base_image)
    print(f"base image {base.name}: {base.recorded_digest}"
          + ("" if base.digest else " (made locally: no registry digest)"), flush=True)
    make_wheelhouse(spec, engine)
    files = context_files(spec)
    buildargs = {"BASE_IMAGE": spec.base_image, "BASE_DIGEST": base.recorded_digest, "BASE_IMAGE_ID": base.image_id,
                 "PYTHON": spec.python, "LOCK_SHA256": lock_sha256(spec.lock), envvars.BUILD_REVISION: _git_revision()}
    print(f"building {spec.tag} from {spec.base_image} "
          f"({sum(path.stat().st_size for path, _ in files) / 2**20:.0f} MiB context)", flush=True)
    try:
        with served_wheels(spec.wheelhouse) as wheels_url:
            stream = engine.api.build(fileobj=streamed_tar(files), custom_context=True, tag=spec.tag,
                                      buildargs={**buildargs, "WHEELS_URL": wheels_url}, network_mode="host",
                                      rm=True, forcerm=True, decode=True)
            print_build_output(stream)
    except docker.errors.APIError as err:
        raise PipelineError(*_engine_refusal(err)) from err
    image = engine.images.get(spec.tag)
    seconds = time.monotonic() - started
    print(f"built {spec.tag} ({image.short_id}, {image.attrs['Size'] / 2**20:.0f} MiB) in {seconds:.0f} s")
    return {"tag": spec.tag, "id": image.id, "size_bytes": image.attrs["Size"], "seconds": seconds,
            "base_digest": base.recorded_digest}


def print_build_output(stream) -> None:
    """The engine's build output, streamed; its first error raised as one line."""
    for chunk in stream:
        if "stream" in chunk:
            sys.stdout.write(chunk["stream"])
            sys.stdout.flush()
        elif "error" in chunk:
            raise PipelineError(f"image build failed: {chunk['error'].strip()}", "read the build output above.")


def _engine_refusal(err) -> tuple[str, str]:
    """(problem, fix) of a build the engine refused before any step ran."""
    said = (getattr(err, "explanation", None) or str(err)).strip()
    if "no space left on device" in said.lower():
        return (f"the Docker engine ran out of disk while building: {said}",
                "free space on the disk holding the engine's data-root (`docker info -f {{.DockerRootDir}}`; "
                "`docker system df` shows what uses it), then rerun. The image's layers take about twice the "
                "wheelhouse's size (a 3.1 GB wheelhouse made a 7.3 GB test image, tests/host/test_host_image.py).")
    return f"the Docker engine refused the build: {said}", "read the engine's message; `docker info` shows its state."


def _git_revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=store.REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def container_run(image: str, argv: list[str]) -> ContainerRun:
    hf_cache = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    compile_cache = Path(os.environ.get(envvars.COMPILE_CACHE) or Path.home() / ".cache" / "neuron-compile-cache")
    devices = host_devices()
    hub_cache = Path(os.environ["HF_HUB_CACHE"]) if os.environ.get("HF_HUB_CACHE") else None
    return ContainerRun(image=image, argv=list(argv), checkpoints=store.checkpoints_root().resolve(),
                        hf_cache=hf_cache, compile_cache=compile_cache, devices=devices,
                        group_add=device_groups(devices), hub_cache=hub_cache)


def host_devices(dev: Path = Path("/dev")) -> list[str]:
    """Every Neuron device, plus the EFA verbs devices multi-node collectives need."""
    return sorted(glob.glob(str(dev / targets.TRN2.device_glob))) + sorted(glob.glob(str(dev / "infiniband" / "uverbs*")))


def device_groups(devices: list[str]) -> list[int]:
    """The groups owning devices that others may not read and write: AWS's hardening sets /dev/neuron* to
    root:neuron 0660 (about-neuron/security.rst), and Docker creates the container's nodes with the host's
    owner and mode, so the container user opens them only as a member of that group."""
    groups = set()
    for device in devices:
        info = os.stat(device)
        if info.st_mode & 0o006 != 0o006:
            groups.add(info.st_gid)
    return sorted(groups)


def _writable_for_image_user(directory: Path) -> None:
    """Root on the host runs the image's non-root user, so the mounts must be writable by it."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        for root, dirs, files in os.walk(directory):
            for name in [root, *(os.path.join(root, d) for d in dirs), *(os.path.join(root, f) for f in files)]:
                os.lchown(name, IMAGE.uid, IMAGE.uid)


def container_key_folder(key: Path) -> Path:
    """The folder of the digest key the container uses: the caller's own (the container runs as the caller); for
    root, whose container runs as the image's user and cannot read root's 0600 key, a folder of that user's beside
    it (0700), so runs saved in one container still resume in the next."""
    key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if os.geteuid() != 0:
        return key.parent
    folder = key.parent / "image-user"
    folder.mkdir(exist_ok=True, mode=0o700)
    os.chown(folder, IMAGE.uid, IMAGE.uid)
    return folder


def run_in_image(request: ContainerRun, engine=None) -> int:
    engine = engine or client()
    if not request.argv:
        raise PipelineError("--run needs a stage, e.g. `--run train --model tiny --path native`.",
                            "give the stage and its arguments after --run.")
    for directory in (request.checkpoints, request.hf_cache, request.compile_cache):
        _writable_for_image_user(directory)
    volumes = {str(request.checkpoints): {"bind": IMAGE.checkpoints, "mode": "rw"},
               str(request.hf_cache): {"bind": IMAGE.hf_cache, "mode": "rw"},
               str(request.compile_cache): {"bind": IMAGE.compile_cache, "mode": "rw"}}
    # Only the name is ever printed; the value goes to the engine and nowhere else.
    environment = {k: os.environ[k] for k in PASSED_THROUGH if os.environ.get(k)}
    environment[targets.NEFF_CACHE_ENV] = IMAGE.compile_cache  # never a host path the container cannot see
    # The host user's DCP digest key (pipeline.run.digest_key): a key made in the container would go with it,
    # and no run saved there could resume. Its folder, outside the checkpoints root, mounted as it is.
    key = digest_key.key_path()
    folder = container_key_folder(key)
    volumes[str(folder)] = {"bind": DIGEST_KEY_MOUNT, "mode": "rw"}
    environment[envvars.DIGEST_KEY] = f"{DIGEST_KEY_MOUNT}/{key.name}"
    if request.hub_cache:  # the host's hub cache where the image's huggingface_hub looks for it
        _writable_for_image_user(request.hub_cache)
        volumes[str(request.hub_cache)] = {"bind": IMAGE.hub_cache, "mode": "rw"}
        environment["HF_HUB_CACHE"] = IMAGE.hub_cache
    # The caller's own uid, so outputs on the mounts belong to them; root gets the image's user.
    user = None if os.geteuid() == 0 else f"{os.geteuid()}:{os.getegid()}"
    extra = {"cap_add": ["IPC_LOCK"], "ulimits": [_memlock_unlimited()]} if request.devices else {}
    if request.group_add:
        extra["group_add"] = [str(gid) for gid in request.group_add]
    groups = f", groups {', '.join(map(str, request.group_add))}" if request.group_add else ""
    print(f"running in {request.image}: python -m pipeline {' '.join(request.argv)} "
          f"({len(request.devices)} devices{groups}; env {sorted(environment) or 'none'})", flush=True)
    return stream_container(engine, request.image, request.argv, volumes=volumes, environment=environment,
                            user=user, devices=[f"{d}:{d}:rwm" for d in request.devices],
                            network_mode="host" if request.network_host else None, shm_size=request.shm_size,
                            **extra)


def _memlock_unlimited():
    from docker.types import Ulimit

    return Ulimit(name="memlock", soft=-1, hard=-1)


def stream_container(engine, image: str, command: list[str], **kwargs) -> int:
    """Run to completion with output streamed; the container never outlives this call."""
    import docker

    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    try:
        container = engine.containers.create(image, command, detach=True, **kwargs)
    except docker.errors.ImageNotFound as err:
        raise PipelineError(f"image {image} is not in the engine.", "build it with `make image` first.") from err
    try:
        container.start()
        for chunk in container.logs(stream=True, follow=True):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
        return int(container.wait()["StatusCode"])
    except KeyboardInterrupt:
        print(f"\ninterrupted: stopping container {container.short_id}", file=sys.stderr, flush=True)
        container.stop(timeout=10)
        raise
    finally:
        container.remove(force=True)


