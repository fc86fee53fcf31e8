"""bench's peers section counts the same tokens on both sides: the pipeline's real (non-padding) tokens of a
recorded batch and the conversations its step-1 batch holds (what TRL scores as "the same rows")."""

from __future__ import annotations

import torch

from bench import peers
from bench.run import real_tokens


def _packed_row() -> dict:
    # Two conversations (5 and 3 tokens, each with labelled assistant tokens) then 4 tokens of padding.
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    labels = torch.tensor([[-100, -100, 7, 8, -100, -100, 9, -100, -100, -100, -100, -100]])
    return {"positions": positions, "labels": labels}


def test_sft_real_tokens_leave_out_the_padding_segment():
    assert real_tokens(_packed_row(), "sft") == 8


def test_dpo_real_tokens_run_to_the_last_labelled_token():
    positions = torch.arange(8).expand(2, -1)
    labels = torch.tensor([[-100, -100, 5, 6, -100, -100, -100, -100], [-100, 3, 4, 5, 6, 7, -100, -100]])
    assert real_tokens({"positions": positions, "labels": labels}, "dpo") == 4 + 6


def test_the_first_batch_conversations_are_the_files_first_ones():
    records = [{"messages": [{"role": "user", "content": str(i)}]} for i in range(5)]
    assert peers._first_batch_conversations(_packed_row(), records) == records[:2]
    two_rows = {key: torch.cat([value, value]) for key, value in _packed_row().items()}
    assert peers._first_batch_conversations(two_rows, records) == records[:4]
