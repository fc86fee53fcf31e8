#!/bin/sh
# Run inside a throwaway container of the base image (pipeline/stages/image.py does this), so the
# wheels match the image's own Python and platform, and what the image installs is derived from the
# base's own packages (docker/wheelhouse.py): the base keeps every package it has, the lock's pins add
# what it lacks, every difference is printed. Writes to OUT (default /wheels):
#   base-packages.json        what the base image already has (pip list)
#   differences.txt           lock vs base: kept at the base's version, or added
#   *.whl                     the packages to add, and the dependencies of those the base lacks
#   requirements.hashed.txt   name==version --hash=sha256:… for every wheel; the Dockerfile installs
#                             exactly this with --require-hashes --no-deps
#   image-packages.txt        base + added: every package the image will hold (doctor checks it)
# Usage: make-wheelhouse.sh PYTHON LOCK [OUT]
set -eu
python="$1"
lock="$2"
out="${3:-/wheels}"
here="$(cd "$(dirname "$0")" && pwd)"
"$python" -m pip list --disable-pip-version-check --format=json > "$out/base-packages.json"
"$python" "$here/wheelhouse.py" plan "$lock" "$out/base-packages.json" "$out"
if [ -s "$out/to-fetch.txt" ]; then
  # Resolve what is missing against the installed base (a dry run changes nothing), with the base's
  # versions as constraints: a lock package that needs another version of a base package fails here.
  "$python" -m pip install --disable-pip-version-check --dry-run --report "$out/install-report.json" \
    -c "$out/constraints.txt" -r "$out/to-fetch.txt"
  "$python" "$here/wheelhouse.py" fetch-list "$out/install-report.json" > "$out/fetch.txt"
  "$python" -m pip wheel --disable-pip-version-check --no-deps --wheel-dir "$out" -r "$out/fetch.txt"
fi
"$python" "$here/wheelhouse.py" finish "$out" "$out/base-packages.json"
