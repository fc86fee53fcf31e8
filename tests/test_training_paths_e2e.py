"""Every training path end to end, 2 steps: train → export → verify, on whichever torchtitan API is
installed (pipeline.titan.api). The full tier covers these flows on torchtitan 0.3.0 in depth (export,
verify, rehearse tests); this module is what the upstream-main tier (`make test-titan-main`) adds to the
fast tests there, and `make test` leaves it out."""

from __future__ import annotations

import json

import pytest

from conftest import copy_model, run_dir, run_pipeline
from pipeline.titan import api

pytestmark = [pytest.mark.slow, pytest.mark.titan_e2e]

CASES = [("tiny", "hf"), ("tiny", "native"), ("tiny", "nki"), ("tiny-moe", "nki")]


@pytest.fixture(scope="module")
def root(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    for model in {model for model, _ in CASES}:
        copy_model(checkpoints, root, model, link=True)
    return root


@pytest.mark.parametrize("model,path", CASES)
def test_trains_exports_and_verifies(root, model, path):
    trained = run_pipeline("train", "--model", model, "--path", path, "--steps", "2", root=root)
    # the ranks really ran on the installed API, not on a fallback
    assert f"torchtitan API: {api.variant()}" in trained.stdout + trained.stderr
    run_pipeline("export", "--model", model, "--path", path, "--dtype", "float32", root=root)
    verified = run_pipeline("verify", "--model", model, "--path", path, root=root)
    assert "PASSED" in verified.stdout
    report = json.loads((run_dir(root, model, path) / "verify.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    # the logged step-1 loss is plain transformers' on the recorded batch: the weights loaded, the batch
    # reached the model as recorded (packed tokens on main), and the loss is torchtitan's
    assert report["passed"] and checks["step1-loss-source"]["passed"], checks["step1-loss-source"]
    assert checks["load"]["passed"]
