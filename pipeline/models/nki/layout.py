"""moe_cte's blockwise layout, built in PyTorch, and a reference of what moe_cte computes over it.

torchtitan's GroupedExperts receives the routed rows already sorted by expert (x_RD, R = tokens ×
top_k, scores applied later by the dispatcher's combine) and the row count of each expert. moe_cte
(nki-library core/moe/moe_cte; contract from moe_cte.py, bwmm_shard_on_I.py and moe_cte_torch.py)
reads instead, with its "tokens" T being our R rows:
- hidden_states [T+1, H]: the rows, plus a zero row T that every padding slot points at;
- token_position_to_id [N·B] int32: for each slot of each block, the row it holds (T for padding);
- block_to_expert [N, 1] int32: the expert of each block. An expert's rows fill ceil(count/B)
  consecutive blocks in row order, an empty expert has none, and the unused blocks at the end
  belong to expert E-1 (the layout nki-library's moe_cte test builds);
- expert_affinities_masked [(T+1)·E, 1]: the weight of (row, expert); one-hot here, since each
  row goes to exactly one expert and the routing score is applied by torchtitan after the experts;
- gate_up_proj_weight [E, H, 2, I] and down_proj_weight [E, I, H]: torchtitan's w1/w3 [E, F, D]
  and w2 [E, D, F], transposed and stacked.
N depends on the shapes alone (nki-library's get_n_blocks: ceil((T - (E-1)) / B) + E - 1, the most
blocks any split of T rows over E experts needs), so every tensor here has a static shape: no host
sync, traceable by torch.compile and by nki_op's fake kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class BlockLayout:
    token_position_to_id: torch.Tensor  # [N*B] int32, padding slots = number of rows
    block_to_expert: torch.Tensor  # [N, 1] int32
    expert_of_row: torch.Tensor  # [R] int64
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.block_to_expert.shape[0]


def num_blocks(rows: int, experts: int, block_size: int) -> int:
    """Blocks enough for any split of `rows` over `experts` (moe_cte test's get_n_blocks, top_k=1)."""
    return max(-(-(rows - (experts - 1)) // block_size) + experts - 1, 1)


def blockwise_layout(tokens_per_expert_E: torch.Tensor, rows: int, block_size: int) -> BlockLayout:
    """The block layout of `rows` expert-sorted rows whose per-expert counts are given (they sum
    to `rows`, as torchtitan's dispatcher guarantees)."""
    experts = tokens_per_expert_E.shape[0]
    blocks = num_blocks(rows, experts, block_size)
    device = tokens_per_expert_E.device
    counts = tokens_per_expert_E.to(torch.int64)
    row_end = counts.cumsum(0)
    row_start = row_end - counts
    block_end = torch.div(counts + block_size - 1, block_size, rounding_mode="floor").cumsum(0)
    block_start = block_end - torch.div(counts + block_size - 1, block_size, rounding_mode="floor")
    row = torch.arange(rows, device=device)
    expert_of_row = torch.searchsorted(row_end, row, right=True)
    slot = block_start[expert_of_row] * block_size + (row - row_start[expert_of_row])
    token_position_to_id = torch.full((blocks * block_size,), rows, dtype=torch.int64, device=device).scatter(0, slot, row)
    block = torch.arange(blocks, device=device)
    block_to_expert = torch.searchsorted(block_end, block, right=True).clamp(max=experts - 1)
    return BlockLayout(token_position_to_id.to(torch.int32), block_to_expert.to(torch.int32).view(blocks, 1),
                       expert_of_row, block_size)


def moe_cte_inputs(x_RD: torch.Tensor, w1_EFD: torch.Tensor, w2_EDF: torch.Tensor, w3_EFD: torch.Tensor,
                   layout: BlockLayout) -> dict[str, torch.Tensor]:
    """moe_cte's tensor arguments for torchtitan's expert-sorted rows and weights (one dtype, x's,
    as moe_cte requires). Differentiable in x and the weights."""
    rows, dim = x_RD.shape
    experts = w1_EFD.shape[0]
    dtype = x_RD.dtype
    hidden = torch.cat([x_RD, x_RD.new_zeros(1, dim)])
    # one-hot by scatter: F.one_hot checks its values on the host, which tracing cannot do
    affinities = x_RD.new_zeros(rows + 1, experts).scatter(1, layout.expert_of_row.view(-1, 1), 1.0).reshape(-1, 1)
    gate_up = torch.stack([w1_EFD.to(dtype).transpose(1, 2), w3_EFD.to(dtype).transpose(1, 2)], dim=2)
    return {
        "hidden_states": hidden,
        "expert_affinities_masked": affinities,
        "gate_up_proj_weight": gate_up.contiguous(),
        "down_proj_weight": w2_EDF.to(dtype).transpose(1, 2).contiguous(),
        "token_position_to_id": layout.token_position_to_id,
        "block_to_expert": layout.block_to_expert,
    }


def moe_cte_reference(hidden_states: torch.Tensor, expert_affinities_masked: torch.Tensor,
                      gate_up_proj_weight: torch.Tensor, down_proj_weight: torch.Tensor,
                      token_position_to_id: torch.Tensor, block_to_expert: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """What moe_cte computes (SiLU, POST_SCALE, accumulating), block by block, in the inputs' dtype:
    out[t] += affinity[t, e] · (silu(x_t W_gate[e]) ⊙ x_t W_up[e]) W_down[e] for each slot of each
    block of expert e. Returns [T+1, H]; row T collects the (zero) padding slots."""
    total, hidden = hidden_states.shape
    experts, _, _, inter = gate_up_proj_weight.shape
    blocks = block_to_expert.shape[0]
    ids = token_position_to_id.to(torch.int64).view(blocks, block_size)
    block_expert = block_to_expert.to(torch.int64).view(blocks)
    affinity = expert_affinities_masked.view(total, experts)
    out = hidden_states.new_zeros(total, hidden)
    for b in range(blocks):
        # index_select with a [1] index: indexing by a 0-d tensor would read its value on the host
        rows, expert = ids[b], block_expert[b:b + 1]
        gate_up = hidden_states[rows] @ gate_up_proj_weight.index_select(0, expert)[0].reshape(hidden, 2 * inter)
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = (h @ down_proj_weight.index_select(0, expert)[0]) * affinity.index_select(1, expert)[rows]
        out = out.index_add(0, rows, y)
    return out


def moe_cte_reference_backward(x_RD: torch.Tensor, tokens_per_expert_E: torch.Tensor, w1_EFD: torch.Tensor,
                               w2_EDF: torch.Tensor, w3_EFD: torch.Tensor, grad_RD: torch.Tensor,
                               block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (x, w1, w2, w3) of experts_blockwise's output [R, D] given grad_RD, block by block
    over moe_cte's layout, without an autograd graph: each block recomputes its SwiGLU from its row
    indices and one expert's weights, adds its share into weight-sized accumulators and drops
    everything else. Memory: the three accumulators (one layer's expert weights in x's dtype), x and
    the gradient padded by moe_cte's zero row, and one block's activations — never a copy of the
    weights per block (differentiating the forward through autograd saved one per block: ~4.5 GiB a
    layer for the trn2-fit MoE). Computed in x's dtype like the forward."""
    rows, dim = x_RD.shape
    dtype = x_RD.dtype
    layout = blockwise_layout(tokens_per_expert_E, rows, block_size)
    blocks = layout.num_blocks
    ids = layout.token_position_to_id.to(torch.int64).view(blocks, block_size)
    block_expert = layout.block_to_expert.to(torch.int64).view(blocks)
    # padding slots read row R: zero input, zero gradient, so they add nothing anywhere
    # Sums in x's dtype, as autograd's own would: a row sits in exactly one block, and an expert's
    # weight gradient gathers only ceil(rows of that expert / block) block products.
    acc = dtype
    hidden = torch.cat([x_RD, x_RD.new_zeros(1, dim)])
    grad = torch.cat([grad_RD.to(dtype), grad_RD.new_zeros(1, dim, dtype=dtype)])
    grad_x = torch.zeros(rows + 1, dim, dtype=acc, device=x_RD.device)
    grad_w1 = torch.zeros(w1_EFD.shape, dtype=acc, device=w1_EFD.device)
    grad_w2 = torch.zeros(w2_EDF.shape, dtype=acc, device=w2_EDF.device)
    grad_w3 = torch.zeros(w3_EFD.shape, dtype=acc, device=w3_EFD.device)
    for b in range(blocks):
        # index_select with a [1] index: indexing by a 0-d tensor would read its value on the host
        slots, expert = ids[b], block_expert[b:b + 1]
        x, dy = hidden[slots], grad[slots]
        w1, w2, w3 = (w.index_select(0, expert)[0].to(dtype) for w in (w1_EFD, w2_EDF, w3_EFD))
        gate, up = x @ w1.T, x @ w3.T
        sig = torch.sigmoid(gate)
        act = gate * sig  # silu
        grad_h = dy @ w2
        grad_w2.index_add_(0, expert, (dy.T @ (act * up)).to(acc).unsqueeze(0))
        grad_up = grad_h * act
        grad_gate = grad_h * up * sig * (1 + gate * (1 - sig))  # silu'(g) = σ(g)(1 + g(1 - σ(g)))
        grad_w1.index_add_(0, expert, (grad_gate.T @ x).to(acc).unsqueeze(0))
        grad_w3.index_add_(0, expert, (grad_up.T @ x).to(acc).unsqueeze(0))
        grad_x.index_add_(0, slots, (grad_gate @ w1 + grad_up @ w3).to(acc))
    return (grad_x[:rows].to(dtype), grad_w1.to(w1_EFD.dtype), grad_w2.to(w2_EDF.dtype), grad_w3.to(w3_EFD.dtype))
