#!/bin/sh
# The image runs pipeline stages: `docker run IMAGE train --model tiny --path native` is
# `python -m pipeline train …`. Anything that is a command on PATH (bash, python) runs as given,
# so the image is also usable as a plain shell for debugging.
set -eu
if [ "$#" -eq 0 ]; then
  set -- doctor
fi
if command -v "$1" >/dev/null 2>&1; then
  exec "$@"
fi
exec /opt/pipeline-venv/bin/python -m pipeline "$@"
