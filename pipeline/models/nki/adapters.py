"""Layout changes between torchtitan's tensors and the kernels' contracts, and nothing else.

torchtitan keeps q/k as [B, S, H, D] and a packed cos|sin cache [max_seq, 2D]; nkilib's rope_hf
wants the Hugging Face layout [B, H, S, D] and a cache of [S, 2D] or, one per batch row,
[B, S, 2D] — so per-token positions (torchtitan's HF loader gives them with every batch, restarting
at 0 for each packed document) become a cache gathered at those positions. The router works on
flattened tokens [T, H]. Kernels take plain tensors: DTensor activations are computed on their
local shard and wrapped back with the same placements (each op is pointwise over the dimensions
torchtitan shards them on: batch, sequence, heads).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def bshd_to_bhsd(x_BSHD: torch.Tensor) -> torch.Tensor:
    # contiguous: the kernel reads HBM with explicit strides (access patterns), not views.
    return x_BSHD.transpose(1, 2).contiguous()


def bhsd_to_bshd(x_BHSD: torch.Tensor) -> torch.Tensor:
    return x_BHSD.transpose(1, 2)


def rope_cache_for(cache_S2D: torch.Tensor, batch: int, seq_len: int,
                   positions_BS: torch.Tensor | None) -> torch.Tensor:
    """[S, 2D] (prefix of the cache) without positions, else [B, S, 2D] gathered at them."""
    if positions_BS is None:
        if cache_S2D.shape[0] < seq_len:
            raise ValueError(f"rope cache holds {cache_S2D.shape[0]} positions, sequence has {seq_len}")
        return cache_S2D[:seq_len].contiguous()
    if positions_BS.shape[-1] != seq_len:
        raise ValueError(f"positions cover {positions_BS.shape[-1]} tokens, sequence has {seq_len}")
    return cache_S2D[positions_BS.expand(batch, seq_len)].contiguous()


def tokens(x_BLD: torch.Tensor) -> torch.Tensor:
    return x_BLD.reshape(-1, x_BLD.shape[-1])


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def like(reference: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t`, computed from reference's local shard, as a DTensor placed like `reference` (if it is one)."""
    if not isinstance(reference, DTensor):
        return t
    return DTensor.from_local(t, reference.device_mesh, reference.placements, run_check=False)
