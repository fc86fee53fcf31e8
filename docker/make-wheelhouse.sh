#!/bin/sh
# Run inside a throwaway container of the base image (pipeline/container.py does this), so the
# wheels match the image's own Python and platform. Writes to /wheels:
#   *.whl                     every requirement of the lock and its dependencies
#   base-freeze.txt           what the base image already has (pip freeze)
#   requirements.hashed.txt   name==version --hash=sha256:… for every wheel the base lacks; the
#                             Dockerfile installs exactly this with --require-hashes --no-deps
# Usage: make-wheelhouse.sh PYTHON LOCK
set -eu
python="$1"
lock="$2"
venv=/tmp/wheelhouse-venv
"$python" -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip freeze --all > /wheels/base-freeze.txt
# Constrain to the base's own versions so torch, torch-neuronx and neuronx-cc resolve to what the
# image already has instead of whatever the index offers.
grep -E '^[A-Za-z0-9._-]+==' /wheels/base-freeze.txt | grep -viE '^(pip|setuptools|wheel)==' > /tmp/base-constraints.txt || true
"$venv/bin/python" -m pip wheel --quiet --wheel-dir /wheels -c /tmp/base-constraints.txt -r "$lock"
"$venv/bin/python" - <<'PY'
import hashlib, pathlib, re

wheels = pathlib.Path("/wheels")
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
base = {}
for line in (wheels / "base-freeze.txt").read_text().splitlines():
    if "==" in line:
        name, version = line.split("==", 1)
        base[norm(name)] = version.strip()
lines = []
for wheel in sorted(wheels.glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    if base.get(norm(name)) == version:
        continue  # already in the base image at this exact version
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    lines.append(f"{norm(name)}=={version} --hash=sha256:{digest}")
(wheels / "requirements.hashed.txt").write_text("\n".join(lines) + "\n")
print(f"wheelhouse: {len(lines)} wheels to install, {len(base)} packages already in the base image")
PY
