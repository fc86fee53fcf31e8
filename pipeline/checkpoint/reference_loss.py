"""The step-1 loss recomputed by plain transformers, independently of torchtitan.

torchtitan trains on packed documents with block-causal attention and per-document
positions. Plain transformers sees each document segment on its own, which is the same
computation; the loss is summed over every rank's recorded first batch and divided by the
total number of label tokens, as torchtitan's global average loss is.
"""

from __future__ import annotations

from pathlib import Path


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


def step1_loss(model, batches: list[dict]) -> float:
    import torch
    import torch.nn.functional as F

    total, count = 0.0, 0
    with torch.no_grad():
        for batch in map(as_rows, batches):
            for row in range(batch["input"].shape[0]):
                for start, end in segments(batch["positions"][row]):
                    ids = batch["input"][row, start:end].unsqueeze(0)
                    labels = batch["labels"][row, start:end]
                    logits = model(input_ids=ids).logits[0].float()
                    total += F.cross_entropy(logits, labels, reduction="sum", ignore_index=-100).item()
                    count += int((labels != -100).sum())
    return total / count


def load_model(checkpoint_dir: Path):
    """Plain transformers, float32, never remote code."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint_dir), dtype=torch.float32,
                                                              trust_remote_code=False)
    return model.eval()


def hf_step1_loss(checkpoint_dir: Path, batches: list[dict]) -> float:
    return step1_loss(load_model(checkpoint_dir), batches)
