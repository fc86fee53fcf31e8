"""Stage `doctor`: a table of what the pipeline needs on this host and what it finds.

Each row is ok, warn (missing but not needed for the resolved target) or FAIL (missing and
needed). Exits non-zero when any row fails. Reads only; never prints a token's value.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from pipeline.run import store, targets
from pipeline.errors import PipelineError

# trn2.48xlarge
NEURON_DEVICES = 16
EFA_DEVICES = 16
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
    found = sorted(glob.glob(str(host.dev / "neuron[0-9]*")))
    return Check("Neuron devices", f"{NEURON_DEVICES} (/dev/neuron*) on trn2", f"{len(found)}",
                 _status(len(found) >= NEURON_DEVICES, target == "trn2"))


def check_neuron_driver(host: Host, target: str) -> Check:
    version = host.sys / "module" / "neuron" / "version"
    found = version.read_text().strip() if version.exists() else "not loaded"
    return Check("Neuron driver", "aws-neuronx-dkms loaded on trn2", found,
                 _status(version.exists(), target == "trn2"))


def check_lnc(target: str) -> Check:
    pipeline_value = targets.TARGETS["trn2"].env["NEURON_LOGICAL_NC_CONFIG"]
    env = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    found = f"{env} (environment)" if env else f"unset; the pipeline sets {pipeline_value} for trn2 runs"
    good = env in (None, pipeline_value)
    return Check("LNC (NEURON_LOGICAL_NC_CONFIG)", f"{pipeline_value} on trn2", found, _status(good, target == "trn2"))


def check_efa(host: Host, target: str) -> Check:
    devices = sorted(p.name for p in (host.sys / "class" / "infiniband").glob("*")
                     if (p / "device").exists() or p.name.startswith(("efa", "rdmap")))
    found = f"{len(devices)} ({', '.join(devices[:3])}{'…' if len(devices) > 3 else ''})" if devices else "none"
    # Multi-node only: a single node trains without EFA, so this is a warning at most.
    return Check("EFA", f"{EFA_DEVICES} for multi-node trn2", found, _status(len(devices) >= EFA_DEVICES, False))


def check_docker() -> Check:
    try:
        import docker

        engine = docker.from_env(timeout=5)
        version = engine.version()
        found = f"{version.get('Version', '?')} (API {version.get('ApiVersion', '?')})"
        good = True
    except Exception as err:  # noqa: BLE001 - whatever the reason, the answer is "no engine"
        found, good = f"not reachable ({type(err).__name__})", False
    where = os.environ.get("DOCKER_HOST", "/var/run/docker.sock")
    # Needed for `make image` and IN_CONTAINER=1 only.
    return Check("Docker engine", f"reachable at {where} for image/IN_CONTAINER", found, _status(good, False))


def check_disk(target: str) -> Check:
    root = store.checkpoints_root()
    probe = next((p for p in (root, *root.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(probe).free / 2**30
    need = DISK_GIB[target]
    return Check("Disk (checkpoints)", f"≥ {need} GiB free at {root}", f"{free:.0f} GiB free", _status(free >= need, True))


def check_hf_token(host: Host, model_is_hub: bool) -> Check:
    token_file = Path(os.environ.get("HF_HOME", host.home / ".cache" / "huggingface")) / "token"
    if os.environ.get("HF_TOKEN"):
        found = "present (HF_TOKEN)"
    elif token_file.exists() and token_file.read_text().strip():
        found = f"present ({token_file})"
    else:
        found = "absent"
    # Qwen3 checkpoints are public: a token only lifts rate limits, so absence is a warning.
    return Check("HF token", "optional (rate limits) for Hub models", found, _status(found != "absent", False))


def _pin_matches(pin: str, installed: str) -> bool:
    if pin.endswith(".*"):
        return installed == pin[:-2] or installed.startswith(pin[:-1])
    return installed == pin or installed.split("+")[0] == pin  # a local build (+cpu) of the pinned release


def check_packages(lock: Path) -> list[Check]:
    if not lock.exists():
        raise PipelineError(f"lock file {lock} does not exist.", "pass --lock with an existing lock file.")
    rows = []
    for line in lock.read_text().splitlines():
        match = re.match(r"^\s*([A-Za-z0-9._-]+)\s*(==\s*([^\s;#]+)|@\s*(\S+))", line)
        if not match:
            continue
        name, pin, url = match.group(1), match.group(3), match.group(4)
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        want = pin or url
        good = installed is not None and (pin is None or _pin_matches(pin, installed))
        rows.append(Check(f"python: {name}", want, installed or "missing", _status(good, True)))
    return rows


def default_lock(target: str) -> Path:
    return store.REPO / ("requirements.lock" if target == "trn2" else "requirements-dev.lock")


def checks(target: str, lock: Path, host: Host = Host(), packages: str = "problems") -> list[Check]:
    rows = [check_neuron_devices(host, target), check_neuron_driver(host, target), check_lnc(target),
            check_efa(host, target), check_docker(), check_disk(target), check_hf_token(host, True)]
    package_rows = check_packages(lock)
    bad = [r for r in package_rows if r.status != "ok"]
    rows.append(Check(f"Python packages ({lock.name})", f"{len(package_rows)} pins",
                      f"{len(package_rows) - len(bad)} match, {len(bad)} differ", "ok" if not bad else "FAIL"))
    rows += package_rows if packages == "all" else bad
    return rows


def table(rows: list[Check]) -> str:
    headers = ("check", "needs", "found", "status")
    cells = [headers, *((r.name, r.needs, r.found, r.status) for r in rows)]
    widths = [max(len(str(row[i])) for row in cells) for i in range(4)]
    lines = ["  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="cpu, cuda or trn2 (detected when unset)")
    parser.add_argument("--lock", type=Path, help="lock to compare against (default: requirements.lock on trn2, "
                                                    "requirements-dev.lock elsewhere)")
    parser.add_argument("--all-packages", action="store_true", help="list every pin, not only the ones that differ")


def run(args: argparse.Namespace) -> list[Check]:
    target = targets.resolve(args.target).name
    rows = checks(target, args.lock or default_lock(target), packages="all" if args.all_packages else "problems")
    print(f"target: {target}")
    print(table(rows))
    failed = [r.name for r in rows if r.status == "FAIL"]
    if failed:
        raise PipelineError(f"{len(failed)} check(s) failed for target {target}: {', '.join(failed[:5])}.",
                            "fix the FAIL rows above (see `make doctor`).")
    return rows
