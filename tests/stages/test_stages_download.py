"""pipeline/stages/download.py: local directories are validated and imported under their own key;
anything else that is not a model is refused in one line, leaving nothing behind."""

import json
import shutil

from pipeline.checkpoint import hf_dir
from helpers import run_pipeline, source_dir


def test_local_directory_import(checkpoints, tmp_path):
    source = tmp_path / "MyQwen"
    shutil.copytree(source_dir(checkpoints, "tiny"), source)
    root = tmp_path / "out"
    result = run_pipeline("download", "--model", str(source), root=root)
    assert "checkpoint ready" in result.stdout
    (home,) = root.glob("local--MyQwen-*")  # keyed by the full source: name and a hash of its path
    assert json.loads((home / "source.json").read_text())["path"] == str(source.resolve())
    assert hf_dir.validate(home / "source").tensors.keys() == hf_dir.validate(source).tensors.keys()


def test_local_directory_with_missing_shard_is_refused(checkpoints, tmp_path):
    source = tmp_path / "Broken"
    shutil.copytree(source_dir(checkpoints, "tiny"), source)
    next(source.glob("model-00002-*.safetensors")).unlink()
    root = tmp_path / "out"
    result = run_pipeline("download", "--model", str(source), root=root, check=False)
    assert result.returncode == 2
    assert "names shards that are missing" in result.stderr and "Traceback" not in result.stderr
    assert not root.exists() or list(root.iterdir()) == []  # nothing half-imported


def test_unknown_model_is_a_clear_error(tmp_path):
    result = run_pipeline("download", "--model", "not-a-model", root=tmp_path, check=False)
    assert result.returncode == 2 and "is not a Hub id" in result.stderr and "Traceback" not in result.stderr
