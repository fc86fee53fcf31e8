import json
import shutil

import pytest

from conftest import run_pipeline
from pipeline import embedded, hf_checkpoint
from pipeline.errors import PipelineError


def test_embedded_checkpoints_are_real_qwen3(checkpoints):
    for name in ("tiny", "tiny-moe"):
        hf = checkpoints / name / "hf"
        report = hf_checkpoint.validate(hf)
        provenance = json.loads((hf / "embedded.json").read_text())
        # pretrained far below the uniform-distribution loss ln(151936) = 11.93
        assert provenance["final_loss"] < 8.0 < provenance["first_loss"]
        assert report.arch.head_dim == 128 != report.arch.hidden_size // report.arch.num_attention_heads
        assert len(list(hf.glob("*.safetensors"))) >= 2 and (hf / "model.safetensors.index.json").exists()
    assert hf_checkpoint.validate(checkpoints / "tiny" / "hf").arch.tie_word_embeddings
    moe = hf_checkpoint.validate(checkpoints / "tiny-moe" / "hf").arch
    assert moe.is_moe and not moe.tie_word_embeddings


def test_tokenizer_is_the_hubs():
    import hashlib

    digest = hashlib.sha256((embedded.tokenizer_dir() / "tokenizer.json").read_bytes()).hexdigest()
    assert digest == embedded.QWEN3_TOKENIZER_SHA256


def test_bootstrap_is_deterministic(tmp_path):
    a = embedded.bootstrap("tiny", tmp_path / "a", steps=2, progress=False)
    b = embedded.bootstrap("tiny", tmp_path / "b", steps=2, progress=False)
    assert a == b
    for shard in sorted((tmp_path / "a").glob("*.safetensors")):
        assert shard.read_bytes() == (tmp_path / "b" / shard.name).read_bytes()


def test_local_directory_import(checkpoints, tmp_path):
    source = tmp_path / "MyQwen"
    shutil.copytree(checkpoints / "tiny" / "hf", source)
    root = tmp_path / "out"
    result = run_pipeline("download", "--model", str(source), root=root)
    assert "checkpoint ready" in result.stdout
    assert hf_checkpoint.validate(root / "MyQwen" / "hf").tensors.keys() == hf_checkpoint.validate(source).tensors.keys()


def test_local_directory_with_missing_shard_is_refused(checkpoints, tmp_path):
    source = tmp_path / "Broken"
    shutil.copytree(checkpoints / "tiny" / "hf", source)
    next(source.glob("model-00002-*.safetensors")).unlink()
    root = tmp_path / "out"
    result = run_pipeline("download", "--model", str(source), root=root, check=False)
    assert result.returncode == 2
    assert "names shards that are missing" in result.stderr and "Traceback" not in result.stderr
    assert not (root / "Broken").exists()  # nothing half-imported


@pytest.mark.parametrize("damage, message", [
    ("truncate", "is truncated"),
    ("pickle", "pickle-based weight files"),
    ("stray", "shards not in model.safetensors.index.json"),
    ("config", "config.json disagrees with the tensors"),
])
def test_damaged_checkpoints_are_refused(checkpoints, tmp_path, damage, message):
    d = tmp_path / "ck"
    shutil.copytree(checkpoints / "tiny" / "hf", d)
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
        hf_checkpoint.validate(d)


def test_unknown_model_is_a_clear_error(tmp_path):
    result = run_pipeline("download", "--model", "not-a-model", root=tmp_path, check=False)
    assert result.returncode == 2 and "is not a Hub id" in result.stderr and "Traceback" not in result.stderr
