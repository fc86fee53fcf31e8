"""Shared fixtures: the embedded checkpoints are made once per session, in a temp folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_pipeline(*args: str, root: Path, check: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m pipeline …` exactly as a user runs it, with outputs under `root`."""
    env = {**os.environ, "PIPELINE_CHECKPOINTS": str(root), "MALLOC_MMAP_THRESHOLD_": "4294967296",
           "MALLOC_TRIM_THRESHOLD_": "4294967296"}
    result = subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"pipeline {' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Path:
    """A checkpoints root holding tiny and tiny-moe (downloaded = made) with their data."""
    root = tmp_path_factory.mktemp("checkpoints")
    for model in ("tiny", "tiny-moe"):
        run_pipeline("download", "--model", model, root=root)
        run_pipeline("data", "--model", model, root=root)
    return root


# The container test builds a full image on a private Docker engine (~20 min cold on 2 cores, seconds
# with the engine's build cache); .ci/run asks for it, a local `make test` only with the variable set.
# The report header says which, either way.
CONTAINER_TESTS = os.environ.get("PIPELINE_CONTAINER_TESTS") == "1"
collect_ignore = [] if CONTAINER_TESTS else ["test_container.py"]


def pytest_report_header(config):
    if not CONTAINER_TESTS:
        return "tests/test_container.py not collected: set PIPELINE_CONTAINER_TESTS=1 (needs root to start dockerd)"
    return "container tests: on"
