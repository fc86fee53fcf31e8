"""Cross-entropy whose LM head runs only on the positions that have a label.

In SFT most positions are prompt or padding (IGNORE_INDEX): computing their logits over a 151,936-word
vocabulary and then ignoring them is most of a small model's step (README, "Against TRL"). Here the model
returns its final hidden states, the positions with a label are gathered, and only they go through the LM
head and the loss. The loss is the same sum over labelled positions divided by the same global count of valid
tokens, so values and gradients are torchtitan's CrossEntropyLoss's up to float rounding.

It is a ChunkedLossWrapper so that torchtitan's own trainer wiring applies on both APIs (trainer.py, "Set
lm_head reference for ChunkedLossWrapper"): the trainer hands it the model's lm_head and sets the model's
`_skip_lm_head`, and the validator receives the same loss. The gather makes the logits' shape depend on the
data, so it is used only where nothing needs a fixed shape or a sharded hidden state (`applies`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper


def applies(*, target: str, compiled: bool, tensor_parallel: int, other_parallel: int, dpo: bool = False) -> str | None:
    """None where the labelled-only head can run, else why not (logged by the rank). other_parallel: the
    context- or pipeline-parallel degree (each splits what the gather would need whole)."""
    if dpo:
        # Measured: with the head called after the model's forward, 2 FSDP ranks' step-2 DPO loss moved 0.05 from
        # 1 rank's; the reference forward's swapped-in head stayed gathered for the policy's (titan.dpo, Reference).
        return "DPO computes its log-probabilities from the model's full logits (titan.dpo)"
    if tensor_parallel > 1:
        return "tensor parallelism shards the hidden states over the sequence (SP) and the head over the vocabulary"
    if other_parallel > 1:
        return "context or pipeline parallelism splits the sequence or the model"
    if compiled:
        return "torch.compile would see a new logits shape at every step"
    if target == "trn2":
        # No Neuron page says how its eager mode or compiler treats a data-dependent shape each step.
        return "no Neuron source covers a data-dependent shape per step; to be measured on trn2 first"
    return None


class LabelledTokensLoss(ChunkedLossWrapper):
    @dataclass(kw_only=True, slots=True)
    class Config(ChunkedLossWrapper.Config):
        num_chunks: int = 1  # one pass over the labelled positions; kept for the parent's config

    def __init__(self, config: Config, *, compile_config=None):
        super().__init__(config, compile_config=None)  # the inner CrossEntropyLoss, never compiled (see `applies`)
        self.head_positions = 0
        """Training positions the LM head ran on since last read (`take_head_positions`): what proves this path ran."""

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None,
                 **loss_inputs: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """pred: the final hidden states, [B, L, D] (0.3.0) or [T, D] (main), as labels [B, L] or [T]."""
        assert self.lm_head is not None, "torchtitan's trainer sets the lm_head (ChunkedLossWrapper)"
        labelled = labels != IGNORE_INDEX
        logits = self.lm_head(pred[labelled])  # [N, V]
        targets = labels[labelled]
        if torch.is_grad_enabled() and pred.requires_grad:  # a training step's, not the validator's (no_grad)
            self.head_positions += targets.numel()
        if labels.dim() == 2:  # 0.3.0's cross_entropy_loss flattens [B, L, V]: one row of N
            logits, targets = logits.unsqueeze(0), targets.unsqueeze(0)
        return self.loss_fn(logits, targets, global_valid_tokens)

    def take_head_positions(self) -> int:
        taken, self.head_positions = self.head_positions, 0
        return taken
