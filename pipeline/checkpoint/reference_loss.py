"""The step-1 loss recomputed by plain transformers, independently of torchtitan.

torchtitan trains on packed documents with block-causal attention and per-document
positions. Plain transformers sees each document segment on its own, which is the same
computation; the loss is summed over every rank's recorded first batch and divided by the
total number of label tokens, as torchtitan's global average loss is.

Ranks of one tensor-parallel group record the same batch (64 files, 16 distinct under TP 4 on a
trn2.48xlarge): each distinct batch is computed once and counted as often as it was recorded,
which gives the same sum.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DistinctBatch:
    digest: str  # sha256 of its tensors (names, dtypes, shapes, bytes)
    tensors: dict
    copies: int  # how many ranks recorded it


def digest(batch: dict) -> str:
    import torch

    hasher = hashlib.sha256()
    for name in sorted(batch):
        tensor = batch[name].contiguous()
        hasher.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def distinct(batches: list[dict]) -> list[DistinctBatch]:
    """The recorded batches by content, in first-seen order, each with its number of copies."""
    found: dict[str, DistinctBatch] = {}
    for batch in batches:
        key = digest(batch)
        seen = found.get(key)
        found[key] = DistinctBatch(key, batch, 1 if seen is None else seen.copies + 1)
    return list(found.values())


def segments(positions_row):
    """(start, end) of each document segment in one packed row: positions restart at 0."""
    starts = (positions_row == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    ends = starts[1:] + [len(positions_row)]
    return list(zip(starts, ends))


def as_rows(batch: dict) -> dict:
    """A recorded batch with [rows, tokens] tensors. torchtitan 0.3.0 records [B, L]; torchtitan main
    folds the batch (#4121) and records [T] packed tokens, which is one row."""
    return {k: v.unsqueeze(0) if v.dim() == 1 else v for k, v in batch.items()}


def loss_terms(model, batch: dict) -> tuple[float, int]:
    """(summed cross-entropy, label tokens) of one recorded batch."""
    import torch
    import torch.nn.functional as F

    batch = as_rows(batch)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in range(batch["input"].shape[0]):
            for start, end in segments(batch["positions"][row]):
                ids = batch["input"][row, start:end].unsqueeze(0)
                labels = batch["labels"][row, start:end]
                logits = model(input_ids=ids).logits[0].float()
                total += F.cross_entropy(logits, labels, reduction="sum", ignore_index=-100).item()
                count += int((labels != -100).sum())
    return total, count


def combine(terms: list[tuple[tuple[float, int], int]]) -> float:
    """((sum, count), copies) per distinct batch → the mean loss over every recorded batch."""
    total = sum(s * copies for (s, _), copies in terms)
    count = sum(c * copies for (_, c), copies in terms)
    return total / count


def step1_loss(model, batches: list[dict]) -> float:
    return combine([(loss_terms(model, b.tensors), b.copies) for b in distinct(batches)])


def load_model(checkpoint_dir: Path):
    """Plain transformers, float32, never remote code."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=torch.float32,
                                                              trust_remote_code=False)
    return model.eval()


def hf_step1_loss(checkpoint_dir: Path, batches: list[dict]) -> float:
    return step1_loss(load_model(checkpoint_dir), batches)
