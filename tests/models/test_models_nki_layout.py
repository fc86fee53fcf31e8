"""moe_cte's blockwise layout (pipeline.models.nki.layout) on CPU, for real: the layout follows
moe_cte's contract, and moe_cte's computation over it equals torchtitan's per-expert loop —
exactly in float32 — for uneven loads, empty experts and padding."""

import itertools
import math

import pytest
import torch

from pipeline.models.nki import layout, ops
from pipeline.models.nki.constraints import MOE_BLOCK_SIZE
from pipeline.models.reference import experts_reference

# (counts per expert, block size): uneven, empty experts (first, middle, last), exact multiples of
# the block, one expert holding everything, every expert tiny.
LOADS = [
    ([3, 0, 300, 2], MOE_BLOCK_SIZE),
    ([0, 513, 0, 0, 1, 256], MOE_BLOCK_SIZE),
    ([256, 256, 256, 256], MOE_BLOCK_SIZE),
    ([5, 0, 9, 1, 0, 7, 2, 0], 4),
    ([0, 0, 0, 12], 4),
    ([1, 1, 1, 1, 1], 8),
]


def _check_layout(counts: list[int], block: int) -> None:
    rows, experts = sum(counts), len(counts)
    lay = layout.blockwise_layout(torch.tensor(counts), rows, block)
    slots = lay.token_position_to_id.tolist()
    owners = lay.block_to_expert.view(-1).tolist()
    assert lay.token_position_to_id.dtype == torch.int32 and lay.block_to_expert.dtype == torch.int32
    assert len(slots) == lay.num_blocks * block and lay.block_to_expert.shape == (lay.num_blocks, 1)
    assert lay.num_blocks == layout.num_blocks(rows, experts, block)
    start = 0
    expected_slots, expected_owners = [], []
    for expert, count in enumerate(counts):  # moe_cte: an expert's rows, in order, padded to whole blocks
        n = math.ceil(count / block)
        expected_slots += list(range(start, start + count)) + [rows] * (n * block - count)
        expected_owners += [expert] * n
        start += count
    spare = lay.num_blocks - len(expected_owners)
    assert spare >= 0, "fewer blocks than the rows need"
    expected_slots += [rows] * (spare * block)  # unused blocks at the end, all padding,
    expected_owners += [experts - 1] * spare  # owned by the last expert (nki-library's test layout)
    assert slots == expected_slots and owners == expected_owners
    assert lay.expert_of_row.tolist() == [e for e, c in enumerate(counts) for _ in range(c)]


@pytest.mark.parametrize("counts,block", LOADS)
def test_layout_follows_moe_cte_contract(counts, block):
    _check_layout(counts, block)


def test_block_count_covers_every_split():
    # N comes from shapes alone; it must hold any split of the rows over the experts.
    for block, experts, rows in itertools.product((1, 2, 3, 4), (1, 2, 3, 4), range(12)):
        for cut in itertools.combinations_with_replacement(range(rows + 1), experts - 1):
            counts = [b - a for a, b in zip((0, *cut), (*cut, rows))]
            _check_layout(counts, block)


def test_moe_cte_inputs_follow_the_kernel_contract():
    counts = torch.tensor([3, 0, 300, 2])
    rows, dim, hidden, experts = int(counts.sum()), 8, 6, 4
    x = torch.randn(rows, dim)
    w1, w2, w3 = torch.randn(experts, hidden, dim), torch.randn(experts, dim, hidden), torch.randn(experts, hidden, dim)
    lay = layout.blockwise_layout(counts, rows, MOE_BLOCK_SIZE)
    got = layout.moe_cte_inputs(x, w1, w2, w3, lay)
    assert got["hidden_states"].shape == (rows + 1, dim) and not got["hidden_states"][rows].any()
    assert torch.equal(got["hidden_states"][:rows], x)
    aff = got["expert_affinities_masked"]
    assert aff.shape == ((rows + 1) * experts, 1)
    assert torch.equal(aff.view(rows + 1, experts)[:rows].argmax(1), lay.expert_of_row)
    assert aff.sum() == rows and not aff.view(rows + 1, experts)[rows].any()
    gate_up, down = got["gate_up_proj_weight"], got["down_proj_weight"]
    assert gate_up.shape == (experts, dim, 2, hidden) and down.shape == (experts, hidden, dim)
    assert torch.equal(gate_up[:, :, 0, :], w1.transpose(1, 2)) and torch.equal(gate_up[:, :, 1, :], w3.transpose(1, 2))
    assert torch.equal(down, w2.transpose(1, 2))
    assert all(t.is_contiguous() for t in got.values())


def _dyadic(shape, gen, scale=4):
    """Values k/scale with |k| ≤ scale: products and sums over ≤ 64 terms are exact in float32."""
    return torch.randint(-scale, scale + 1, shape, generator=gen).float() / scale


def _one_hot_down(experts, dim, hidden, gen):
    """w2 [E, D, F] with one power-of-two entry per output row: each down-projection output is one
    exact product, whatever order a matmul sums in."""
    w2 = torch.zeros(experts, dim, hidden)
    picks = torch.randint(0, hidden, (experts, dim), generator=gen)
    powers = 2.0 ** torch.randint(-2, 3, (experts, dim), generator=gen) * (torch.randint(0, 2, (experts, dim), generator=gen) * 2 - 1)
    w2.scatter_(2, picks.unsqueeze(-1), powers.unsqueeze(-1).float())
    return w2


@pytest.mark.parametrize("counts,block", LOADS)
def test_blockwise_equals_per_expert_loop_exactly_in_float32(counts, block):
    # MKL's float32 matmul rounds differently for small row counts (measured: 1-3, 5-7, 9-11 rows
    # differ from the same rows inside a larger matmul), so "exactly" needs inputs whose sums are
    # exact in any order; a wrong row, slot, block or expert still changes the result.
    gen = torch.Generator().manual_seed(sum(counts) + block)
    rows, experts, dim, hidden = sum(counts), len(counts), 64, 32
    x = _dyadic((rows, dim), gen)
    w1, w3 = _dyadic((experts, hidden, dim), gen), _dyadic((experts, hidden, dim), gen)
    w2 = _one_hot_down(experts, dim, hidden, gen)
    tokens = torch.tensor(counts)
    lay = layout.blockwise_layout(tokens, rows, block)
    out = layout.moe_cte_reference(**layout.moe_cte_inputs(x, w1, w2, w3, lay), block_size=block)
    loop = experts_reference(x, tokens, w1, w2, w3)
    assert out.dtype == torch.float32
    assert torch.equal(out[:rows], loop)
    assert not out[rows].any()  # the padding row only ever receives zeros


def test_experts_op_matches_per_expert_loop_with_gradients():
    gen = torch.Generator().manual_seed(7)
    counts = torch.tensor([3, 0, 300, 2, 0, 40])
    rows, experts, dim, hidden = int(counts.sum()), 6, 32, 16
    leaves = [torch.randn(s, generator=gen, dtype=torch.float32, requires_grad=True)
              for s in ((rows, dim), (experts, hidden, dim), (experts, dim, hidden), (experts, hidden, dim))]
    grad = torch.randn(rows, dim, generator=gen)
    got = ops.experts(leaves[0], counts, *leaves[1:], False)
    got_grads = torch.autograd.grad(got, leaves, grad)
    want = experts_reference(leaves[0], counts, *leaves[1:])
    want_grads = torch.autograd.grad(want, leaves, grad)
    # float32 sums in another order (blocks of 256 rows): equal to float32 rounding of the largest value
    for g, w in zip((got, *got_grads), (want, *want_grads)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6 * w.abs().max().item())
