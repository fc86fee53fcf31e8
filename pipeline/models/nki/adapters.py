"""Layout changes between torchtitan's tensors and the kernels' contracts, and nothing else.

torchtitan keeps q/k as [B, S, H, D] and a packed cos|sin cache [max_seq, 2D]; nkilib's rope_hf
wants the Hugging Face layout [B, H, S, D] and a cache sliced to the sequence ([S, 2D]). The
router works on flattened tokens [T, H].
"""

from __future__ import annotations

import torch


def bshd_to_bhsd(x_BSHD: torch.Tensor) -> torch.Tensor:
    # contiguous: the kernel reads HBM with explicit strides (access patterns), not views.
    return x_BSHD.transpose(1, 2).contiguous()


def bhsd_to_bshd(x_BHSD: torch.Tensor) -> torch.Tensor:
    return x_BHSD.transpose(1, 2)


def rope_cache_for(cache_S2D: torch.Tensor, seq_len: int) -> torch.Tensor:
    if cache_S2D.shape[0] < seq_len:
        raise ValueError(f"rope cache holds {cache_S2D.shape[0]} positions, sequence has {seq_len}")
    return cache_S2D[:seq_len].contiguous()


def tokens(x_BLD: torch.Tensor) -> torch.Tensor:
    return x_BLD.reshape(-1, x_BLD.shape[-1])
