"""pipeline/checkpoint/stream.py: .safetensors written tensor by tensor (export's shards) or by
several writers at their offsets (the trainer's weights copy) read back exactly, by safetensors."""

import hashlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from pipeline.checkpoint import stream

TENSORS = {
    "embed": torch.randn(7, 5),
    "half": torch.randn(3, 4).to(torch.bfloat16),
    "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "flags": torch.tensor([True, False, True]),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 4),
    "strided": torch.randn(4, 6).t(),  # not contiguous
}


def test_written_tensor_by_tensor_reads_back_exactly(tmp_path):
    path = tmp_path / "a.safetensors"
    entries = [stream.entry_of(k, v) for k, v in TENSORS.items()]
    with stream.SafetensorsWriter(path, entries, metadata={"format": "pt", "step": "3"}) as writer:
        for value in TENSORS.values():
            writer.write(value)
        digest = writer.close()
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = load_file(str(path))
    assert loaded.keys() == TENSORS.keys()
    for key, value in TENSORS.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "step": "3"}


def test_positional_writes_in_any_order_make_the_same_file(tmp_path):
    """What each rank does for its shard: header first, then bytes at offsets, in any order."""
    entries = [stream.entry_of(k, v) for k, v in TENSORS.items()]
    sequential = tmp_path / "seq.safetensors"
    with stream.SafetensorsWriter(sequential, entries, metadata={"format": "pt"}, sync=False) as writer:
        for value in TENSORS.values():
            writer.write(value)
        writer.close()
    plan = stream.layout(entries, {"format": "pt"})
    positional = tmp_path / "pos.safetensors"
    with open(positional, "wb") as handle:
        handle.write(plan.header)
        handle.truncate(plan.size)
    import os

    fd = os.open(positional, os.O_WRONLY)
    for key in reversed(list(TENSORS)):
        value = TENSORS[key]
        rows = value.shape[0] if value.dim() else 1
        for row in range(rows):  # row by row, as shards of several ranks would be
            part = value[row:row + 1] if value.dim() else value
            row_bytes = part.numel() * part.element_size()
            stream.pwrite_all(fd, stream.tensor_bytes(part), plan.offsets[key] + row * row_bytes, positional)
    os.close(fd)
    assert positional.read_bytes() == sequential.read_bytes()


def test_writing_other_than_declared_is_refused(tmp_path):
    entries = [stream.Entry("x", "float32", (2, 2))]
    with stream.SafetensorsWriter(tmp_path / "b.safetensors", entries) as writer:
        with pytest.raises(ValueError, match="declared float32"):
            writer.write(torch.zeros(2, 2, dtype=torch.float64))
    with stream.SafetensorsWriter(tmp_path / "c.safetensors", entries) as writer:
        with pytest.raises(ValueError, match="never written"):
            writer.close()
    with pytest.raises(ValueError, match="given twice"):
        stream.layout([entries[0], entries[0]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_finite_finds_every_nan_and_infinity_and_survives_an_overflowing_sum(dtype):
    dtype = getattr(torch, dtype)
    big = torch.finfo(dtype).max
    assert stream.finite(torch.full((4096,), big, dtype=dtype))  # the sum overflows: the exact check decides
    assert stream.finite(torch.zeros(0, dtype=dtype))
    for bad in (float("nan"), float("inf"), -float("inf")):
        tensor = torch.randn(1000, dtype=torch.float32).to(dtype)
        tensor[417] = bad
        assert not stream.finite(tensor), bad
    both = torch.zeros(8, dtype=dtype)
    both[0], both[1] = float("inf"), -float("inf")
    assert not stream.finite(both)
