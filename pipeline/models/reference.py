"""Float-exact references: the contract each kernel must meet, runnable anywhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def experts_reference(x_RD: torch.Tensor, tokens_per_expert_E: torch.Tensor, w1_EFD: torch.Tensor,
                      w2_EDF: torch.Tensor, w3_EFD: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each expert over its contiguous slice of expert-sorted tokens.

    x_RD: tokens sorted by expert; tokens_per_expert_E: how many belong to each expert;
    w1/w3: [E, F, D] gate/up; w2: [E, D, F] down. Returns [R, D] in x's dtype.
    """
    outputs = []
    start = 0
    for expert, count in enumerate(tokens_per_expert_E.tolist()):
        x = x_RD[start : start + count]
        start += count
        hidden = F.silu(x @ w1_EFD[expert].to(x.dtype).T) * (x @ w3_EFD[expert].to(x.dtype).T)
        outputs.append(hidden @ w2_EDF[expert].to(x.dtype).T)
    return torch.cat(outputs) if outputs else x_RD.new_zeros(x_RD.shape)
