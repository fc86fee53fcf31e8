#!/usr/bin/env bash
# A private Docker engine for CI and the container tests: its own data-root, exec-root and
# socket, so it never touches (or depends on) a system dockerd. Stopped by its own PID.
#   source .ci/dockerd.sh && dockerd_start   # exports DOCKER_HOST
#   ...                                       # tests/host/test_host_image.py uses it
#   dockerd_stop
# or as a command: .ci/dockerd.sh start|stop|status (start prints the DOCKER_HOST to export).
# Needs root (dockerd does); installs Debian's docker.io when dockerd is missing.

DOCKERD_DIR="${DOCKERD_DIR:-/tmp/pipeline-dockerd}"

dockerd_install() {
  command -v dockerd >/dev/null 2>&1 && return 0
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
}

dockerd_start() {
  local sock="$DOCKERD_DIR/docker.sock" pidfile="$DOCKERD_DIR/dockerd.pid"
  export DOCKER_HOST="unix://$sock"
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    return 0
  fi
  dockerd_install || { echo "dockerd.sh: could not install docker.io" >&2; return 1; }
  mkdir -p "$DOCKERD_DIR/data" "$DOCKERD_DIR/exec"
  # Only the engine's own pidfile is trusted for stopping it later, never a process name.
  dockerd --data-root "$DOCKERD_DIR/data" --exec-root "$DOCKERD_DIR/exec" --pidfile "$pidfile" \
    -H "$DOCKER_HOST" >"$DOCKERD_DIR/dockerd.log" 2>&1 &
  local i
  for i in $(seq 1 60); do
    if [ -S "$sock" ] && [ -f "$pidfile" ]; then
      echo "dockerd.sh: engine up at $DOCKER_HOST (pid $(cat "$pidfile"), ${i}x0.5 s)" >&2
      return 0
    fi
    sleep 0.5
  done
  echo "dockerd.sh: dockerd did not start; last log lines:" >&2
  tail -n 20 "$DOCKERD_DIR/dockerd.log" >&2
  return 1
}

dockerd_stop() {
  local pidfile="$DOCKERD_DIR/dockerd.pid" pid i
  [ -f "$pidfile" ] || return 0
  pid="$(cat "$pidfile")"
  kill "$pid" 2>/dev/null || true
  for i in $(seq 1 40); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "dockerd.sh: dockerd $pid ignored SIGTERM for 20 s; sending SIGKILL" >&2
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  case "${1:-}" in
    start) dockerd_start && echo "export DOCKER_HOST=$DOCKER_HOST" ;;
    stop) dockerd_stop ;;
    status) [ -f "$DOCKERD_DIR/dockerd.pid" ] && kill -0 "$(cat "$DOCKERD_DIR/dockerd.pid")" ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
  esac
fi
