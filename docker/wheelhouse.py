"""What the pipeline image installs on top of its base: derived from the base image's own packages.

Runs with the base image's Python (standard library only; make-wheelhouse.sh calls it) and on the host
in tests, against a stand-in base. The rule: a package the base already has keeps the base's version
(the Neuron DLC ships torch, torch-neuronx, neuronx-cc and torchtitan-neuron built to work together),
a package it lacks is added at the lock's pin, and every difference between the lock and the result is
printed and written down (differences.txt), so one lock and one base are one set of packages.

  plan LOCK BASE_JSON OUT CORE
                              BASE_JSON: `pip list --format=json` of the base. Writes OUT/to-fetch.txt
                              (the lock's pins the base lacks), OUT/constraints.txt (the base's versions,
                              so dependencies resolve to what the base has) and OUT/differences.txt.
                              CORE: comma-separated packages the pipeline's code depends on; the base's
                              version of one of them outside the lock's pin is refused (OUT/refused.txt,
                              exit 2), naming both versions.
  fetch-list REPORT           `pip install --dry-run --report` JSON -> one requirement per package to add
  finish WHEELS BASE_JSON     OUT/requirements.hashed.txt (every wheel to install, sha256) and
                              OUT/image-packages.txt (base + added: what the image will hold)
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;#]+)|@\s*(\S+))\s*(?:#.*)?$")
TOOLS = {"pip", "setuptools", "wheel"}  # the installer's own, never constrained


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Pin:
    name: str
    version: str | None = None  # name==version
    url: str | None = None  # name @ url

    @property
    def requirement(self) -> str:
        return f"{self.name} @ {self.url}" if self.url else f"{self.name}=={self.version}"


def parse_lock(text: str) -> list[Pin]:
    pins = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = PIN.match(line)
        if not match:
            raise ValueError(f"lock line {number} is not `name==version` or `name @ url`: {line.strip()!r}")
        name, version, url = match.groups()
        if version and "*" in version:
            raise ValueError(f"lock line {number} pins {name}=={version}: a wildcard is not one version")
        pins.append(Pin(name, version, url))
    return pins


def parse_base(pip_list_json: str) -> dict[str, str]:
    return {normalize(p["name"]): p["version"] for p in json.loads(pip_list_json)}


@dataclass
class InstallPlan:
    add: list[Pin]  # the base lacks these: installed at the lock's pin
    kept: list[tuple[Pin, str]]  # the base has these at another version (or from a URL): the base's stays
    same: list[Pin]  # the base has exactly the pin
    refused: list[str]  # core packages the base has outside the lock's pin: one line each, both versions

    def differences(self) -> list[str]:
        lines = [f"{pin.name}: lock {pin.version or pin.url}, base image {version} (kept)" for pin, version in self.kept]
        lines += [f"{pin.name}: not in the base image, added at {pin.version or pin.url}" for pin in self.add]
        return lines


def same_release(pin: str, have: str) -> bool:
    """PEP 440 `==pin` for a pin without a local label: 2.14.0+cpu is torch 2.14.0 built for CPU."""
    return have == pin or ("+" not in pin and have.split("+", 1)[0] == pin)


def url_commit(url: str) -> str | None:
    match = re.search(r"@([0-9a-f]{40})$", url)
    return match.group(1) if match else None


def installed_commit(name: str) -> str | None:
    """The VCS commit pip recorded for an installed package (PEP 610 direct_url.json), if any: an install
    from a clone (`pip install -e .`, how AWS installs torchtitan-neuron) records a directory, no commit."""
    try:
        text = metadata.distribution(name).read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    return (json.loads(text).get("vcs_info") or {}).get("commit_id") if text else None


def core_conflict(pin: Pin, have: str, commit: str | None) -> str | None:
    """One line naming the lock's and the base's version of a core package, or None when they agree
    (or cannot be compared: a URL pin against an install that recorded no commit)."""
    if pin.version is not None:
        if same_release(pin.version, have):
            return None
        return f"{pin.name}: the base image has {have}, the lock pins {pin.version}"
    wanted = url_commit(pin.url or "")
    if commit is None or wanted is None or commit == wanted:
        return None
    return f"{pin.name}: the base image has {have} at commit {commit}, the lock pins commit {wanted}"


def plan(pins: list[Pin], base: dict[str, str], core: frozenset[str] = frozenset(),
         commit_of=installed_commit) -> InstallPlan:
    add, kept, same, refused = [], [], [], []
    for pin in pins:
        have = base.get(normalize(pin.name))
        if have is None:
            add.append(pin)
        elif pin.version is not None and have == pin.version:
            same.append(pin)
        else:
            kept.append((pin, have))
            if normalize(pin.name) in core:
                conflict = core_conflict(pin, have, None if pin.version else commit_of(pin.name))
                if conflict:
                    refused.append(conflict)
    return InstallPlan(add, kept, same, refused)


def constraints(base: dict[str, str]) -> str:
    return "".join(f"{name}=={version}\n" for name, version in sorted(base.items()) if name not in TOOLS)


def fetch_list(report: dict) -> list[str]:
    """Requirements for exactly what pip's resolver would add (index packages by version, VCS by commit)."""
    out = []
    for item in report.get("install", []):
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        info = item.get("download_info", {})
        vcs = info.get("vcs_info")
        if vcs:
            out.append(f"{name} @ {vcs['vcs']}+{info['url']}@{vcs['commit_id']}")
        else:
            out.append(f"{name}=={version}")
    return out


def wheel_name_version(wheel: Path) -> tuple[str, str]:
    name, version = wheel.name.split("-")[:2]
    return normalize(name), version


def finish(wheels: Path, base: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    hashed, image = [], dict(base)
    for wheel in sorted(wheels.glob("*.whl")):
        name, version = wheel_name_version(wheel)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        hashed.append(f"{name}=={version} --hash=sha256:{digest}")
        image[name] = version
    return hashed, image


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "plan":
        lock, base_json, out = Path(args[0]), Path(args[1]), Path(args[2])
        core = frozenset(normalize(name) for name in args[3].split(",") if name.strip())
        try:
            pins = parse_lock(lock.read_text())
        except ValueError as err:
            print(f"error: {lock}: {err}", file=sys.stderr)
            return 2
        base = parse_base(base_json.read_text())
        result = plan(pins, base, core)
        if result.refused:
            # The code is written and tested against the lock's versions of these: a base that ships
            # others is not silently kept (the host reads refused.txt for its one-line error).
            (out / "refused.txt").write_text("; ".join(result.refused) + "\n")
            print(f"error: {'; '.join(result.refused)}", file=sys.stderr)
            return 2
        (out / "to-fetch.txt").write_text("".join(p.requirement + "\n" for p in result.add))
        (out / "constraints.txt").write_text(constraints(base))
        differences = result.differences()
        (out / "differences.txt").write_text("".join(line + "\n" for line in differences))
        print(f"base image: {len(base)} packages; lock: {len(pins)} pins, {len(result.same)} as pinned, "
              f"{len(result.kept)} kept at the base's version, {len(result.add)} to add")
        for line in differences:
            print(f"  {line}")
    elif command == "fetch-list":
        print("\n".join(fetch_list(json.loads(Path(args[0]).read_text()))))
    elif command == "finish":
        wheels, base = Path(args[0]), parse_base(Path(args[1]).read_text())
        hashed, image = finish(wheels, base)
        (wheels / "requirements.hashed.txt").write_text("".join(line + "\n" for line in hashed))
        (wheels / "image-packages.txt").write_text("".join(f"{n}=={v}\n" for n, v in sorted(image.items())))
        print(f"wheelhouse: {len(hashed)} wheels to install over {len(base)} base packages")
    else:
        print(f"unknown command {command!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
