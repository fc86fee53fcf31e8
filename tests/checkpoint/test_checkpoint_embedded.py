"""pipeline/checkpoint/embedded.py: the tiny models made offline are real Qwen3 checkpoints, made
deterministically with the Hub's tokenizer."""

import hashlib
import json

from pipeline.checkpoint import embedded, hf_dir
from helpers import source_dir


def test_embedded_checkpoints_are_real_qwen3(checkpoints):
    for name in ("tiny", "tiny-moe"):
        source = source_dir(checkpoints, name)
        report = hf_dir.validate(source)
        provenance = json.loads((source / "embedded.json").read_text())
        # pretrained far below the uniform-distribution loss ln(151936) = 11.93
        assert provenance["final_loss"] < 8.0 < provenance["first_loss"]
        assert report.arch.head_dim == 128 != report.arch.hidden_size // report.arch.num_attention_heads
        assert len(list(source.glob("*.safetensors"))) >= 2 and (source / "model.safetensors.index.json").exists()
    assert hf_dir.validate(source_dir(checkpoints, "tiny")).arch.tie_word_embeddings
    moe = hf_dir.validate(source_dir(checkpoints, "tiny-moe")).arch
    assert moe.is_moe and not moe.tie_word_embeddings


def test_tokenizer_is_the_hubs():
    digest = hashlib.sha256((embedded.tokenizer_dir() / "tokenizer.json").read_bytes()).hexdigest()
    assert digest == embedded.QWEN3_TOKENIZER_SHA256


def test_bootstrap_is_deterministic(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = embedded.bootstrap("tiny", tmp_path / "a", steps=2, progress=False)
    b = embedded.bootstrap("tiny", tmp_path / "b", steps=2, progress=False)
    assert a == b
    shards = sorted((tmp_path / "a").glob("*.safetensors"))
    assert shards
    for shard in shards:
        assert shard.read_bytes() == (tmp_path / "b" / shard.name).read_bytes()
