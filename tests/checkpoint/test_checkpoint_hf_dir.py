"""pipeline/checkpoint/hf_dir.py: a damaged HF checkpoint directory is refused, naming the damage."""

import json
import shutil

import pytest

from pipeline.checkpoint import hf_dir
from pipeline.errors import PipelineError
from helpers import source_dir


@pytest.mark.parametrize("damage, message", [
    ("truncate", "is truncated"),
    ("pickle", "pickle-based weight files"),
    ("stray", "shards not in model.safetensors.index.json"),
    ("config", "config.json disagrees with the tensors"),
])
def test_damaged_checkpoints_are_refused(checkpoints, tmp_path, damage, message):
    d = tmp_path / "ck"
    shutil.copytree(source_dir(checkpoints, "tiny"), d)
    shard = next(d.glob("model-00001-*.safetensors"))
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "pickle":
        (d / "pytorch_model.bin").write_bytes(b"not even read")
    elif damage == "stray":
        shutil.copy(shard, d / "model-extra.safetensors")
    elif damage == "config":
        cfg = json.loads((d / "config.json").read_text())
        cfg["hidden_size"] = 96
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PipelineError, match=message):
        hf_dir.validate(d)
