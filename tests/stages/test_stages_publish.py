"""pipeline/stages/publish.py against a stand-in Hub on 127.0.0.1 (tests/stand_in_hub.py: the HTTP calls
huggingface_hub's create_repo and upload_folder make, every file a "regular" upload, no LFS or Xet)."""

from __future__ import annotations

import hashlib
import json

import pytest

from pipeline.checkpoint import manifest
from helpers import run_dir, run_pipeline
from stand_in_hub import TOKEN, hub, publish  # noqa: F401 - hub is a fixture

pytestmark = pytest.mark.slow  # exports and verifies a trained run


def test_a_verified_export_is_published_exactly_and_the_token_never_shown(export_runs, hub):
    endpoint, received = hub
    root = export_runs
    run_pipeline("export", "--model", "tiny", "--path", "native", "--dtype", "float32", "--force", root=root)
    refused = publish(root, endpoint, check=False)
    assert refused.returncode == 2 and "never verified" in refused.stderr and not received["files"]
    run_pipeline("verify", "--model", "tiny", "--path", "native", root=root)
    export = run_dir(root, "tiny", "native") / "export"

    dry = publish(root, endpoint, "--dry-run")
    assert "would publish" in dry.stdout and "  model-00001-of-00002.safetensors" in dry.stdout and not received["created"]

    done = publish(root, endpoint)
    assert "published team/tiny-sft at commit abc123" in done.stdout
    assert TOKEN not in done.stdout + done.stderr + dry.stdout
    assert [(c["organization"], c["name"], c["visibility"]) for c in received["created"]] == [("team", "tiny-sft", "private")]
    listed = manifest.check(export)
    assert set(received["files"]) == {*listed["files"], manifest.MANIFEST}
    for name, data in received["files"].items():
        assert data == (export / name).read_bytes(), name
    shard = "model-00001-of-00002.safetensors"  # tiny's source layout, which the export keeps
    assert hashlib.sha256(received["files"][shard]).hexdigest() == listed["files"][shard]["sha256"]
    assert "verified" in received["message"]
    record = json.loads((run_dir(root, "tiny", "native") / "published.json").read_text())
    assert record["commit"] == "abc123" and record["repo"] == "team/tiny-sft"


def test_a_wrong_token_is_one_line_without_the_token(export_runs, hub):
    endpoint, received = hub
    run_pipeline("export", "--model", "tiny", "--path", "native", "--dtype", "float32", "--force", root=export_runs)
    run_pipeline("verify", "--model", "tiny", "--path", "native", root=export_runs)
    refused = publish(export_runs, endpoint, token="hf_wrong_token_987", check=False)
    assert refused.returncode == 2 and "HTTP 401" in refused.stderr and "write token" in refused.stderr
    assert "hf_wrong_token_987" not in refused.stdout + refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
