"""Batches in the layout the installed torchtitan gives its modules (pipeline.titan.api): [B, L, …]
on torchtitan 0.3.0, [T, …] packed tokens on upstream main (#4121 folded the batch). Tests build
[B, L] batches whose rows each start a document, so folding them packs the same documents."""

from __future__ import annotations

from pipeline.titan import api


def fold(*tensors):
    """[B, L, …] → what torchtitan's modules take: unchanged on 0.3.0, [B·L, …] on main."""
    folded = tuple(t.flatten(0, 1) if api.folded_batch() else t for t in tensors)
    return folded if len(folded) > 1 else folded[0]


def unfold(tensor, batch: int):
    """The inverse of fold for a module's output."""
    return tensor.unflatten(0, (batch, -1)) if api.folded_batch() else tensor


def mask_rows(positions_BL):
    """(positions as torchtitan's mask builders take them, their [rows, L] view): main builds one
    mask over the folded row."""
    if api.folded_batch():
        flat = positions_BL.flatten()
        return flat, flat.unsqueeze(0)
    return positions_BL, positions_BL
