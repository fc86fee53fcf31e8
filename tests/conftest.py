"""Session fixtures: the embedded checkpoints, made once, and runs with checkpoints for export
and verify. The test tree mirrors pipeline/: tests/<package>/test_<module>.py tests
pipeline/<package>/<module>.py; helpers shared by several modules are in tests/helpers.py."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.helpers import EXPORT_MODELS, EXPORT_NPROC, TRAINED_STEPS, copy_model, run_pipeline  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Path:
    """A checkpoints root holding tiny and tiny-moe (downloaded = made) with their data."""
    root = tmp_path_factory.mktemp("checkpoints")
    for model in ("tiny", "tiny-moe"):
        run_pipeline("download", "--model", model, root=root)
        run_pipeline("data", "--model", model, root=root)
    return root


@pytest.fixture(scope="session")
def export_runs(checkpoints, tmp_path_factory) -> Path:
    """A checkpoints root of its own (the shared one's source/ and data/ linked in) with, per model,
    a native run that ran STEPS=0 and then resumed to STEPS=2: its checkpoint/ keeps step-0 and step-2."""
    root = tmp_path_factory.getbasetemp() / "export-runs"
    shutil.rmtree(root, ignore_errors=True)
    for model in EXPORT_MODELS:
        copy_model(checkpoints, root, model, link=True)
        for steps in ("0", str(TRAINED_STEPS)):
            run_pipeline("train", "--model", model, "--path", "native", "--steps", steps,
                         "--nproc-per-node", EXPORT_NPROC[model], root=root)
    return root


# The container test builds a full image on a private Docker engine (~20 min cold on 2 cores, seconds
# with the engine's build cache); .ci/run asks for it, a local `make test` only with the variable set.
# The report header says which, either way.
CONTAINER_TESTS = os.environ.get("PIPELINE_CONTAINER_TESTS") == "1"
CONTAINER_TEST_FILE = "stages/test_image.py"
collect_ignore = [] if CONTAINER_TESTS else [CONTAINER_TEST_FILE]


def pytest_report_header(config):
    if not CONTAINER_TESTS:
        return f"tests/{CONTAINER_TEST_FILE} not collected: set PIPELINE_CONTAINER_TESTS=1 (needs root to start dockerd)"
    return "container tests: on"
