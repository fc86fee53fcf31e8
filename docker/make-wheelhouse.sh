#!/bin/sh
# Run inside a throwaway container of the base image (pipeline/host/image.py does this), so the
# wheels match the image's own Python and platform, and what the image installs is derived from the
# base's own packages (docker/wheelhouse.py): the base keeps every package it has, the lock's pins add
# what it lacks, every difference is printed. Writes to OUT (default /wheels):
#   base-packages.json        what the base image already has (pip list)
#   differences.txt           lock vs base: kept at the base's version, or added
#   *.whl                     the packages to add, and the dependencies of those the base lacks
#   requirements.hashed.txt   name==version --hash=sha256:… for every wheel; the Dockerfile installs
#                             exactly this with --require-hashes --no-deps
#   image-packages.txt        base + added: every package the image will hold (doctor checks it)
#   lock.txt                  the lock this was made from
#   refused.txt               only when the base has a package the code depends on (CORE_PACKAGES,
#                             comma-separated; pipeline/launch/image.py names them) outside the lock's pin
# Usage: CORE_PACKAGES=torch,... make-wheelhouse.sh PYTHON LOCK [OUT]
set -eu
python="$1"
lock="$2"
out="${3:-/wheels}"
core="${CORE_PACKAGES:?CORE_PACKAGES must name the packages whose base version is checked against the lock}"
rm -f "$out/refused.txt"
here="$(cd "$(dirname "$0")" && pwd)"
# pip of the base's own Python; a system Python without pip (Debian's) gets a venv that sees its packages.
if "$python" -m pip --version >/dev/null 2>&1; then
  pip="$python"
else
  "$python" -m venv --system-site-packages /tmp/wheelhouse-pip
  pip=/tmp/wheelhouse-pip/bin/python
fi
cp "$lock" "$out/lock.txt"
"$pip" -m pip list --disable-pip-version-check --format=json > "$out/base-packages.json"
"$pip" "$here/wheelhouse.py" plan "$lock" "$out/base-packages.json" "$out" "$core"
if [ -s "$out/to-fetch.txt" ]; then
  # Resolve what is missing against the installed base (a dry run changes nothing), with the base's
  # versions as constraints: a lock package that needs another version of a base package fails here.
  "$pip" -m pip install --disable-pip-version-check --dry-run --report "$out/install-report.json" \
    -c "$out/constraints.txt" -r "$out/to-fetch.txt"
  "$pip" "$here/wheelhouse.py" fetch-list "$out/install-report.json" > "$out/fetch.txt"
  "$pip" -m pip wheel --disable-pip-version-check --no-deps --wheel-dir "$out" -r "$out/fetch.txt"
fi
"$pip" "$here/wheelhouse.py" finish "$out" "$out/base-packages.json"
