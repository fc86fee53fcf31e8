"""The LM head and loss on labelled positions only (pipeline.titan.labelled_loss) equal torchtitan's
CrossEntropyLoss over every position's logits, in value and gradient, on the installed API's batch shape; where
it must not run, the rank is told why."""

from __future__ import annotations

import pytest
import torch
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss

from pipeline.titan import api
from pipeline.titan.labelled_loss import LabelledTokensLoss, applies

VOCAB, DIM = 50, 8


def _case(shape: tuple[int, ...], seed: int = 0):
    torch.manual_seed(seed)
    head = torch.nn.Linear(DIM, VOCAB, bias=False)
    hidden = torch.randn(*shape, DIM, requires_grad=True)
    labels = torch.randint(0, VOCAB, shape)
    labels[torch.rand(shape) < 0.6] = IGNORE_INDEX  # prompts and padding, as SFT rows have
    return head, hidden, labels


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def _shape(tokens_per_row: int) -> tuple[int, ...]:
    """A batch of the installed API: main's folded [T], 0.3.0's [B, L]."""
    return (3 * tokens_per_row,) if api.variant() == api.MAIN else (3, tokens_per_row)


def test_equals_cross_entropy_over_every_position():
    shape = _shape(16)
    head, hidden, labels = _case(shape)
    valid = (labels != IGNORE_INDEX).sum()
    full, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(head(hidden), labels, valid)
    loss_fn = LabelledTokensLoss(LabelledTokensLoss.Config())
    assert isinstance(loss_fn, ChunkedLossWrapper)  # what makes torchtitan's trainer hand it the lm_head
    loss_fn.set_lm_head(head)
    calls = []
    head.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    labelled, _ = loss_fn(hidden, labels, valid)
    assert calls == [int(valid)] and int(valid) < labels.numel()  # the head ran once, on the labelled rows only
    torch.testing.assert_close(labelled, full, rtol=1e-6, atol=1e-6)
    for got, want in zip(_grads(labelled, hidden, head.weight), _grads(full, hidden, head.weight)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert loss_fn.take_head_positions() == int(valid) and loss_fn.take_head_positions() == 0
    with torch.no_grad():
        loss_fn(hidden, labels, valid)  # the validator's: not a training step's positions
    assert loss_fn.take_head_positions() == 0


def test_a_batch_with_no_label_gives_zero_loss():
    head, hidden, labels = _case(_shape(8))
    labels[:] = IGNORE_INDEX
    loss_fn = LabelledTokensLoss(LabelledTokensLoss.Config())
    loss_fn.set_lm_head(head)
    loss, _ = loss_fn(hidden, labels, torch.tensor(1))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.count_nonzero(head.weight.grad) == 0


@pytest.mark.parametrize("kwargs,reason", [
    ({"tensor_parallel": 2}, "tensor parallelism"),
    ({"other_parallel": 2}, "context or pipeline"),
    ({"compiled": True}, "torch.compile"),
    ({"target": "trn2"}, "Neuron"),
    ({"dpo": True}, "DPO"),
])
def test_where_it_does_not_run_the_reason_is_given(kwargs, reason):
    settings = {"target": "cpu", "compiled": False, "tensor_parallel": 1, "other_parallel": 1}
    assert applies(**settings) is None
    assert reason in applies(**{**settings, **kwargs})
