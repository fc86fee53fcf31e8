"""titan/trainer.py's HF save: each rank marks, hashes and fsyncs its share of the consolidated shards."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.titan import trainer
from pipeline.titan.trainer import WeightsCheckpointManager


def test_rank0_fsyncs_the_index_but_never_another_ranks_marked_copy(tmp_path, monkeypatch):
    """Rank 1 writes `.<shard>.pt` and renames it over its shard while rank 0 lists the folder: rank 0 fsyncing
    that name failed with FileNotFoundError on torchtitan main's API (CI, tiny-moe nki on 2 ranks)."""
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        save_file({"w": torch.ones(2)}, str(tmp_path / name))  # as torch's consolidation writes: no metadata
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    (tmp_path / ".model-00002-of-00002.safetensors.pt").write_bytes(b"rank 1's copy, renamed away any moment")
    fsynced = []
    monkeypatch.setattr(trainer, "fsync_file", lambda path: fsynced.append(path.name))
    # Rank 1's share as all_gather_object would bring it (no process group here).
    rank1 = {"model-00002-of-00002.safetensors": {"sha256": "from rank 1"}}
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda every, mine: every.__setitem__(
        slice(None), [mine, rank1]))

    hashes = WeightsCheckpointManager._hash_shards(tmp_path, rank=0, world=2)

    assert sorted(fsynced) == ["model-00001-of-00002.safetensors", "model.safetensors.index.json"]
    assert set(hashes) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    with safe_open(str(tmp_path / "model-00001-of-00002.safetensors"), "pt") as shard:
        assert shard.metadata() == {"format": "pt"}
