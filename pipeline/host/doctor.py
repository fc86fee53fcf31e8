"""A table of what the pipeline needs and what it finds, where the stages will run.

Each row is ok, warn (missing but not needed for the resolved target, or not set up yet) or FAIL
(missing and needed); any FAIL exits non-zero. Runs before `make setup` on the standard library
alone (the Docker engine is asked over its socket). Packages are those of the environment the stages
run in: the project venv, or — with IN_CONTAINER=1 — the pipeline image, checked inside it against
the package set its build recorded, plus the torchtitan internals the pipeline uses. Never prints a token.
"""

from __future__ import annotations

import glob
import http.client
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from pipeline import envvars
from pipeline.errors import PipelineError
from pipeline.run import store, targets
from pipeline.launch.image import IMAGE

# Free space under checkpoints/: a 4B bf16 checkpoint plus two fp32 DCP checkpoints with optimizer state.
DISK_GIB = {"trn2": 200, "cuda": 200, "cpu": 2}


@dataclass(frozen=True)
class Host:
    """Where facts come from; tests point these at a fake tree."""

    dev: Path = Path("/dev")
    sys: Path = Path("/sys")
    home: Path = Path.home()


@dataclass(frozen=True)
class Check:
    name: str
    needs: str
    found: str
    status: str  # ok | warn | FAIL


def _status(good: bool, needed: bool) -> str:
    return "ok" if good else ("FAIL" if needed else "warn")


def check_neuron_devices(host: Host, target: str) -> Check:
    found = sorted(glob.glob(str(host.dev / targets.TRN2.device_glob)))
    return Check("Neuron devices", f"{targets.TRN2.chips} (/dev/neuron*) on trn2", f"{len(found)}",
                 _status(len(found) >= targets.TRN2.chips, target == "trn2"))


def check_neuron_driver(host: Host, target: str) -> Check:
    version = host.sys / "module" / "neuron" / "version"
    found = version.read_text().strip() if version.exists() else "not loaded"
    return Check("Neuron driver", "aws-neuronx-dkms loaded on trn2", found,
                 _status(version.exists(), target == "trn2"))


def check_lnc(target: str) -> Check:
    pipeline_value = targets.TARGETS["trn2"].env[targets.LNC_ENV]
    env = os.environ.get(targets.LNC_ENV)
    found = f"{env} (environment)" if env else f"unset; the pipeline sets {pipeline_value} for trn2 runs"
    good = env in (None, pipeline_value)
    return Check("LNC (NEURON_LOGICAL_NC_CONFIG)", f"{pipeline_value} on trn2", found, _status(good, target == "trn2"))


def check_efa(host: Host, target: str) -> Check:
    devices = sorted(p.name for p in (host.sys / "class" / "infiniband").glob("*")
                     if (p / "device").exists() or p.name.startswith(("efa", "rdmap")))
    found = f"{len(devices)} ({', '.join(devices[:3])}{'…' if len(devices) > 3 else ''})" if devices else "none"
    # Multi-node only: a single node trains without EFA, so this is a warning at most.
    return Check("EFA", f"{targets.TRN2.efa_devices} for multi-node trn2", found, _status(len(devices) >= targets.TRN2.efa_devices, False))


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


def docker_version(docker_host: str, timeout: float = 5.0) -> dict:
    """GET /version of the Docker Engine API at DOCKER_HOST (unix:// or tcp://, no TLS)."""
    scheme, _, rest = docker_host.partition("://")
    if scheme == "unix":
        connection = _UnixHTTPConnection(rest, timeout)
    elif scheme in ("tcp", "http"):
        connection = http.client.HTTPConnection(rest, timeout=timeout)
    else:
        raise ValueError(f"{scheme}:// endpoints are not probed")
    try:
        connection.request("GET", "/version")
        response = connection.getresponse()
        if response.status != 200:
            raise ConnectionError(f"HTTP {response.status}")
        return json.loads(response.read())
    finally:
        connection.close()


def check_docker(needed: bool = False) -> Check:
    where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        version = docker_version(where)
        found, good = f"{version.get('Version', '?')} (API {version.get('ApiVersion', '?')})", True
    except (OSError, ValueError, http.client.HTTPException) as err:  # whatever the reason: no engine to use
        found, good = f"not reachable ({type(err).__name__}: {getattr(err, 'strerror', None) or err})", False
    # Needed for `make image`, and for every stage when they run in the image (IN_CONTAINER=1).
    return Check("Docker engine", f"reachable at {where}" + ("" if needed else " for image/IN_CONTAINER"), found,
                 _status(good, needed))


def check_python() -> Check:
    """The interpreter `make setup` builds .venv with (the Makefile's PYTHON) or the one running here."""
    tools = [m for m in ("venv", "ensurepip") if importlib.util.find_spec(m) is None]
    good = sys.version_info >= (3, 11) and not tools
    found = f"{platform.python_version()} ({sys.executable})" + (f"; no {'/'.join(tools)} module" if tools else "")
    return Check("Python", "3.11 or newer with venv and ensurepip", found, _status(good, True))


def check_compiler(target: str) -> Check:
    # torchtitan compiles its block-mask creation even with compile off, so torch needs a C++ compiler
    # and Python's headers at run time (docs/design.md, docs/sources.md). The trn2 image has its own.
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    missing = [name for name, there in (("C++ compiler", compiler), (str(headers), headers.exists())) if not there]
    found = f"{compiler}, {headers.name} present" if not missing else f"missing: {', '.join(missing)}"
    return Check("C++ compiler, Python headers", "g++ and Python.h (torch compiles masks at run time)", found,
                 _status(not missing, target != "trn2"))


def check_disk(target: str) -> Check:
    root = store.checkpoints_root()
    probe = next((p for p in (root, *root.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free / 2**30
    need = DISK_GIB[target]
    return Check("Disk (checkpoints)", f"≥ {need} GiB free at {root}", f"{free:.0f} GiB free", _status(free >= need, True))


def check_hf_token(host: Host, model_is_hub: bool) -> Check:
    token_file = Path(os.environ.get("HF_HOME", host.home / ".cache" / "huggingface")) / "token"
    if os.environ.get(envvars.HF_TOKEN):
        found = "present (HF_TOKEN)"
    elif token_file.exists() and token_file.read_text().strip():
        found = f"present ({token_file})"
    else:
        found = "absent"
    # Qwen3 checkpoints are public: a token only lifts rate limits, so absence is a warning.
    return Check("HF token", "optional (rate limits) for Hub models", found, _status(found != "absent", False))


@dataclass(frozen=True)
class Environment:
    """Where the stages' Python packages live: a venv's site-packages, or this interpreter's sys.path."""

    description: str
    paths: tuple[str, ...] | None = None  # None: sys.path

    def installed(self) -> dict[str, str]:
        """canonical name → version (PEP 503 names, as pip compares them)."""
        found = {}
        for dist in metadata.distributions(**({} if self.paths is None else {"path": list(self.paths)})):
            name = dist.metadata["Name"]
            if name:
                found.setdefault(_canonical(name), dist.version)
        return found


    def package_dir(self, name: str) -> Path | None:
        """Where the import package `name` lives in this environment (without importing it)."""
        if self.paths is None:
            spec = importlib.util.find_spec(name)
            return Path(spec.origin).parent if spec and spec.origin else None
        return next((Path(p) / name for p in self.paths if (Path(p) / name / "__init__.py").exists()), None)


def check_torchtitan_api(env: "Environment | None") -> Check:
    """Which of the two torchtitan APIs the stages will run on (pipeline.titan.api: told apart by what the
    package declares, never by its version: PyPI's 0.3.0 and torchtitan-neuron's 0.2.2 base differ while
    upstream main also says 0.2.2), and whether AWS's torchtitan_neuron (its Qwen3 configs) is importable."""
    from pipeline.titan import api

    needs = "torchtitan 0.3.0 or upstream-main API"
    if env is None:
        return Check("torchtitan API", needs, "no project venv yet: `make setup` installs it", "warn")
    package = env.package_dir("torchtitan")
    if package is None:
        return Check("torchtitan API", needs, f"torchtitan not installed in {env.description}", "FAIL")
    neuron = env.package_dir("torchtitan_neuron")
    found = (f"{api.DESCRIPTION[api.variant_at(package)]}; torchtitan_neuron "
             + (f"importable ({neuron})" if neuron else "not installed (only the image has it)"))
    return Check("torchtitan API", needs, found, "ok")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def environment(venv: Path | None) -> Environment | None:
    """The project venv when it exists; else this interpreter when it is itself a venv (the image's, a
    user's own); else None: before `make setup` there is no environment to check yet."""
    if venv is not None and (Path(venv) / "pyvenv.cfg").exists():
        sites = sorted(str(p) for p in Path(venv).glob("lib/python3*/site-packages"))
        return Environment(f"{venv}", tuple(sites))
    if sys.prefix != sys.base_prefix:
        return Environment(f"{sys.prefix} (this interpreter)")
    return None


def _requirements(lock: Path) -> list:
    from packaging.requirements import InvalidRequirement, Requirement

    requirements = []
    for number, line in enumerate(lock.read_text().splitlines(), 1):
        text = line.split(" #", 1)[0].strip()
        if not text or text.startswith(("#", "-")):
            continue
        try:
            requirements.append(Requirement(text))
        except InvalidRequirement as err:
            raise PipelineError(f"{lock}:{number} is not a requirement ({err}).", "fix the lock line.") from err
    return requirements


def check_packages(lock: Path, env: Environment | None = Environment("this interpreter")) -> list[Check]:
    """One row per lock line against `env`'s installed distributions."""
    if not lock.exists():
        raise PipelineError(f"lock file {lock} does not exist.", "pass --lock with an existing lock file.")
    installed = env.installed()
    rows = []
    for requirement in _requirements(lock):
        version = installed.get(_canonical(requirement.name))
        good = version is not None and (requirement.url is not None or
                                        requirement.specifier.contains(version, prereleases=True))
        want = str(requirement.specifier).removeprefix("==") or requirement.url or "any"
        rows.append(Check(f"python: {requirement.name}", want, version or "missing", _status(good, True)))
    return rows


def package_rows(lock: Path, env: Environment | None, packages: str) -> list[Check]:
    title = f"Python packages ({lock.name})"
    if env is None:
        pins = sum(1 for line in lock.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#"))
        return [Check(title, f"{pins} pins", "no project venv yet: `make setup` installs them", "warn")]
    if importlib.util.find_spec("packaging") is None:
        # Only a bare system Python lacks it (every environment the stages run in has it, through
        # transformers); the lock is not half-parsed by hand: the rows say how to get them compared.
        return [Check(title, "compared with `packaging`", f"not compared: {sys.executable} has no `packaging`; "
                      f"run {env.description}/bin/python -m pipeline doctor", "warn")]
    rows = check_packages(lock, env)
    bad = [r for r in rows if r.status != "ok"]
    summary = Check(title, f"{len(rows)} pins in {env.description}", f"{len(rows) - len(bad)} match, {len(bad)} differ",
                    "ok" if not bad else "FAIL")
    return [summary, *(rows if packages == "all" else bad)]


def default_lock(target: str) -> Path:
    return store.REPO / ("requirements.lock" if target == "trn2" else "requirements-dev.lock")


def check_neuron_python(target: str, env: Environment | None, in_image: bool = False) -> Check:
    """Stages on trn2 need TorchNeuron in the environment they run in (the venv, or the image)."""
    found = (env.installed() if env is not None else {}).get("torch-neuronx")
    if found is None:
        found = ("missing from the image (BASE_IMAGE must be a Neuron PyTorch image)" if in_image else
                 "missing (stages run in the image: IN_CONTAINER=1, the default on a Neuron host whose venv lacks it)")
    where = "in the image" if in_image else "on this host"
    return Check(f"torch-neuronx (stages {where})", f"installed for trn2 stages {where}", found,
                 _status(not found.startswith("missing"), target == "trn2"))


def checks(target: str, lock: Path, host: Host = Host(), packages: str = "problems",
           venv: Path | None = store.REPO / ".venv", in_container: bool = False, image: str | None = None,
           engine=None) -> list[Check]:
    rows = [check_python(), check_compiler(target), check_neuron_devices(host, target),
            check_neuron_driver(host, target), check_lnc(target), check_efa(host, target),
            check_docker(needed=in_container), check_disk(target), check_hf_token(host, True)]
    if not lock.exists():
        raise PipelineError(f"lock file {lock} does not exist.", "pass --lock with an existing lock file.")
    env = environment(venv)
    if not in_container:
        if target == "trn2":
            rows.append(check_neuron_python(target, env))
        return rows + [check_torchtitan_api(env)] + package_rows(lock, env, packages)
    # The stages run in the image: the host venv only runs image/doctor/launch (the dev lock).
    return rows + package_rows(store.REPO / "requirements-dev.lock", env, packages) + image_rows(target, image, engine)


def image_rows(target: str, image: str | None, engine=None) -> list[Check]:
    """The pipeline image: present, and its packages checked inside it."""
    from pipeline.launch.image import default_tag

    image = image or default_tag(store.REPO / "requirements.lock", os.environ.get("BASE_IMAGE"))
    try:
        import docker
    except ImportError:
        return [Check("Pipeline image", image, "not checked: the Docker SDK is not installed yet (make setup)", "warn")]
    try:
        engine = engine or docker.from_env(timeout=30)
        engine.images.get(image)
    except docker.errors.ImageNotFound:
        return [Check("Pipeline image", image, "not built yet (make image builds it)", "warn")]
    except Exception as err:  # noqa: BLE001 - no engine is reported by the Docker row already
        return [Check("Pipeline image", image, f"not checked ({type(err).__name__})", "warn")]
    try:
        output = engine.containers.run(image, ["doctor", "--inside-image", "--target", target], remove=True,
                                       stdout=True, stderr=False)
        inside = [Check(**row) for row in json.loads(output.decode().strip().splitlines()[-1])]
    except Exception as err:  # noqa: BLE001 - an image that cannot run its own check is broken
        return [Check("Pipeline image", image, f"present, but its check failed ({type(err).__name__}: "
                                               f"{str(err).strip()[:200]})", "FAIL")]
    return [Check("Pipeline image", image, "present", "ok")] + [
        Check(f"image: {row.name}", row.needs, row.found, row.status) for row in inside]


def inside_image_rows(target: str, record: Path = Path(IMAGE.record), lock: Path | None = None) -> list[Check]:
    """Run inside the image: its packages against what its build recorded (the base's versions kept,
    the lock's added: docker/wheelhouse.py), every lock package present, the torchtitan internals."""
    from pipeline.titan import internals

    rows = []
    # The lock the image was built from (its build records it), else the one shipped in the image.
    lock = lock or (record / "lock.txt" if (record / "lock.txt").exists() else Path(IMAGE.lock))
    recorded_file = record / "image-packages.txt"
    if not recorded_file.exists():
        return [Check("package record", str(recorded_file), "missing (image not built by make image)", "FAIL")]
    recorded = dict(line.split("==", 1) for line in recorded_file.read_text().splitlines() if "==" in line)
    installed = {_normalize(d.metadata["Name"]): d.version for d in metadata.distributions()}
    differ = sorted(f"{n} {installed.get(n, 'missing')} (recorded {v})" for n, v in recorded.items()
                    if installed.get(n) != v)
    rows.append(Check("packages as built", f"{len(recorded)} recorded in {recorded_file}",
                      f"{len(recorded) - len(differ)} match" + (f"; differ: {', '.join(differ[:5])}" if differ else ""),
                      _status(not differ, True)))
    wanted = [m.group(1) for m in (re.match(r"^\s*([A-Za-z0-9._-]+)\s*(==|@)", line)
                                   for line in lock.read_text().splitlines()) if m]
    absent = [name for name in wanted if _normalize(name) not in installed]
    differences = (record / "differences.txt").read_text().splitlines() if (record / "differences.txt").exists() else []
    kept = [line for line in differences if line.endswith("(kept)")]
    rows.append(Check("lock packages", f"{len(wanted)} of {lock} present",
                      f"{len(wanted) - len(absent)} present" + (f"; absent: {', '.join(absent)}" if absent else "")
                      + (f"; {len(kept)} at the base image's version ({record / 'differences.txt'})" if kept else ""),
                      _status(not absent, True)))
    rows += core_package_rows(lock, installed)
    rows.append(check_torchtitan_api(Environment("the image")))
    missing = internals.missing_internals(internals.internals_for(target))
    shown = ", ".join(missing[:3]) + (f" … ({len(missing)} in all)" if len(missing) > 3 else "")
    rows.append(Check("torchtitan internals", f"those of torchtitan {internals.WRITTEN_AGAINST} the pipeline uses",
                      f"torchtitan {internals.torchtitan_version()}: " + (f"missing {shown}" if missing else "all present"),
                      _status(not missing, True)))
    if target == "trn2":
        rows.append(check_neuron_python(target, Environment("the image"), in_image=True))
    return rows


def _normalize(name: str) -> str:
    return _canonical(name)


def _recorded_commit(name: str) -> str | None:
    """The VCS commit pip recorded for an installed package (PEP 610), None for an install from a clone.
    docker/wheelhouse.py reads the same at build time, in the base's Python, before the pipeline is there."""
    try:
        text = metadata.distribution(name).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    return (json.loads(text).get("vcs_info") or {}).get("commit_id") if text else None


def core_package_rows(lock: Path, installed: dict[str, str], commit_of=_recorded_commit) -> list[Check]:
    """The packages the pipeline's code depends on (pipeline/launch/image.py) against the lock's pins: the
    image keeps the base's versions, and for these a version outside the lock's is a FAIL naming both."""
    from pipeline.launch.image import CORE_PACKAGES, COMMIT

    rows = []
    for requirement in _requirements(lock):
        name = _canonical(requirement.name)
        if name not in CORE_PACKAGES:
            continue
        have = installed.get(name)
        if requirement.url:
            wanted = COMMIT.search(requirement.url)
            commit = commit_of(requirement.name) if have else None
            if have is None:
                found, status = "missing", "FAIL"
            elif commit is None or wanted is None:
                found, status = f"{have} (no commit recorded by its install: not compared)", "warn"
            else:
                found = f"{have} at commit {commit}"
                status = _status(commit == wanted.group(1), True)
            needs = f"commit {wanted.group(1) if wanted else requirement.url}"
        else:
            needs = str(requirement.specifier).removeprefix("==")
            found = have or "missing"
            status = _status(have is not None and requirement.specifier.contains(have, prereleases=True), True)
        rows.append(Check(f"code depends on: {requirement.name}", f"lock {needs}", found, status))
    return rows


def table(rows: list[Check]) -> str:
    headers = ("check", "needs", "found", "status")
    cells = [headers, *((r.name, r.needs, r.found, r.status) for r in rows)]
    widths = [max(len(str(row[i])) for row in cells) for i in range(4)]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


