"""A Hub download leaves <key>/source linking to its snapshot in the HF cache, relative when the cache
is under the checkpoints root (HF_HOME on the shared filesystem): the path a cluster's run.json names.
No Hub here: the HF cache is made from tiny's files in huggingface_hub's layout, with the download's
record, so `download` takes its already-downloaded path (which checks the snapshot and links it)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from helpers import run_pipeline, source_dir

pytestmark = pytest.mark.slow  # needs the session's embedded tiny
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(hub_cache, files) -> None:
    """models--org--name/{snapshots/<commit>/*, refs/main} as huggingface_hub writes it."""
    repo = hub_cache / "models--test-org--tiny-hub"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(files, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)


def test_hub_download_links_source_under_the_shared_root(checkpoints, tmp_path):
    shared = tmp_path / "fsx" / "checkpoints"
    hf_home = shared / ".hf"
    fake_hub_cache(hf_home / "hub", source_dir(checkpoints))
    from pipeline.run import store

    store.home("test-org/tiny-hub", shared).write_record(repo_id="test-org/tiny-hub", revision=COMMIT, commit=COMMIT)
    env = {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        run_pipeline("download", "--model", "test-org/tiny-hub", "--revision", COMMIT, root=shared)
        link = shared / "test-org--tiny-hub" / "source"
        assert link.is_symlink() and not os.readlink(link).startswith("/")  # relative: any mount point
        assert link.resolve() == (hf_home / "hub" / "models--test-org--tiny-hub" / "snapshots" / COMMIT).resolve()
        # The same tree mounted elsewhere (another node's mount point): the link still reads the weights.
        moved = tmp_path / "elsewhere"
        shutil.move(str(tmp_path / "fsx"), moved)
        assert (moved / "checkpoints" / "test-org--tiny-hub" / "source" / "config.json").is_file()
        shutil.move(str(moved), tmp_path / "fsx")
        # launch (on a host mounting the shared root where the nodes do) names that link, not the snapshot path.
        out = tmp_path / "o"
        run_pipeline("launch", "--scheduler", "slurm", "--nodes", "2", "--model", "test-org/tiny-hub", "--target",
                     "cpu", "--revision", COMMIT, "--runtime", "venv", "--cluster-checkpoints", str(shared),
                     "--output", str(out), root=shared)
        spec = json.loads((out / "run.json").read_text())
        assert spec["source_dir"] == f"{shared}/test-org--tiny-hub/source" and spec["arch"]["hidden_size"] == 64
        script = (out / "train.sbatch").read_text()
        assert f"export HF_HOME={hf_home}" in script and "export HF_HUB_OFFLINE=1" in script
        assert "HF_TOKEN=" not in script
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
