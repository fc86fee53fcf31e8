"""pipeline/models/cpu_overrides.py and the CPU mask patch in pipeline/titan/patches.py: the
block-causal packed-document mask torchtitan builds, made without its compiled block-sparsity
search (every block "partial"), and turned dense once per forward, is exactly the mask the
original path makes, for the dense attention and for FlexAttention itself."""

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, create_mask, flex_attention
from torchtitan.models.common.attention import get_causal_mask_mod, get_efficient_causal_mask_mod_for_packed_document

from pipeline.models.cpu_overrides import dense_mask
from pipeline.titan.patches import all_partial_block_mask
from titan_batch import mask_rows


def packed_positions(batch: int, length: int) -> torch.Tensor:
    """Per-document positions restarting at 0, documents of uneven lengths (as the loader packs)."""
    rows = []
    for b in range(batch):
        row, doc = [], 5 + 7 * b
        while len(row) < length:
            row += list(range(min(doc, length - len(row))))
            doc = doc * 3 % 41 + 3
        rows.append(row)
    return torch.tensor(rows)


@pytest.mark.parametrize("batch", [1, 2])
def test_dense_mask_of_the_all_partial_block_mask_is_create_masks(batch):
    titan_positions, positions = mask_rows(packed_positions(batch, 96))
    rows, length = positions.shape
    mask_mod = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(titan_positions))
    block_mask = all_partial_block_mask(mask_mod, rows, None, length, length, BLOCK_SIZE=32)
    expected = create_mask(mask_mod, rows, None, length, length, device="cpu")
    dense = dense_mask(block_mask, rows, length, "cpu")
    assert dense.dtype == torch.bool and torch.equal(dense.expand_as(expected), expected)
    assert dense_mask(block_mask, rows, length, "cpu") is dense  # made once per forward, for every layer
    # ... and it is the packed-document causal mask: no token sees another document or the future.
    doc = torch.cumsum(positions == 0, dim=1)
    truth = (doc[:, :, None] == doc[:, None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    assert torch.equal(dense[:, 0], truth)


def test_flex_attention_gives_the_same_output_with_either_block_mask():
    """The all-partial BlockMask is a valid mask for any consumer, not only the dense override."""
    torch.manual_seed(0)
    titan_positions, positions = mask_rows(packed_positions(2, 64))
    rows, length = positions.shape
    mask_mod = and_masks(get_causal_mask_mod(), get_efficient_causal_mask_mod_for_packed_document(titan_positions))
    q, k, v = (torch.randn(rows, 2, length, 16) for _ in range(3))
    searched = create_block_mask(mask_mod, rows, None, length, length, device="cpu", BLOCK_SIZE=16)
    partial = all_partial_block_mask(mask_mod, rows, None, length, length, BLOCK_SIZE=16)
    assert int(partial.kv_num_blocks.sum()) > int(searched.kv_num_blocks.sum())  # no sparsity searched
    assert torch.allclose(flex_attention(q, k, v, block_mask=partial), flex_attention(q, k, v, block_mask=searched),
                          atol=1e-6)
