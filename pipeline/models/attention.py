"""Attention backends of torchtitan's Qwen3 (native and nki paths), chosen by `attention_backend`.

- `flex`: torchtitan's FlexAttention. It runs through `torch.compile` with Inductor (the block mask
  and the attention kernel alike, torchtitan/models/common/attention.py), so it needs a device
  Inductor can target: CPU (with models/cpu_overrides.py's dense-mask replacement for the backward)
  and CUDA.
- `document_sdpa`: no Inductor anywhere, for `neuron`, whose torch.compile backend lowers through
  StableHLO to neuronx-cc and does not use Inductor (neuron:torch/compile/about-torch-compile.html,
  docs/sources.md). torchtitan's `varlen` backend builds the per-document metadata with plain
  tensor ops; `document_sdpa` replaces its CUDA-only flash-varlen kernel through the override registry
  with F.scaled_dot_product_attention under the same block-causal document mask. Same math as flex.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.config import derive, override
from torchtitan.models.common.attention import VarlenAttention, VarlenMetadata

from pipeline.models.attention_backends import DOCUMENT_SDPA
from pipeline.titan import api


def document_ids(meta: VarlenMetadata, batch: int, length: int) -> torch.Tensor:
    """[B, L] document index of every token, from the packed cumulative starts of create_varlen_metadata."""
    starts = meta.cu_seq_q[:-1].to(torch.long)
    token = torch.arange(batch * length, device=starts.device)
    return (torch.searchsorted(starts, token, right=True) - 1).view(batch, length)


def document_mask(meta: VarlenMetadata, batch: int, length: int, device) -> torch.Tensor:
    """[B, 1, L, L] bool: causal and inside the same document."""
    doc = document_ids(meta, batch, length).to(device)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)


class DocumentSDPA(VarlenAttention):
    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        pass

    def __init__(self, config: Config) -> None:
        # Not VarlenAttention.__init__: it activates a CUDA flash-varlen implementation this never calls.
        super(VarlenAttention, self).__init__()
        if tuple(config.window_size) != (-1, 0):
            raise ValueError(f"document_sdpa: window_size {config.window_size} is not plain causal attention")
        self.window_size = config.window_size

    @api.forward_signature_of(VarlenAttention.forward)
    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks: VarlenMetadata, scale=None, enable_gqa=False,
                out_transform=None, **kwargs):
        if out_transform is not None:
            raise NotImplementedError("document_sdpa supports plain masked attention only")
        (q_BLNH, k_BLNH, v_BLNH), added = api.with_batch_dim(4, q_BLNH, k_BLNH, v_BLNH)
        batch, length = q_BLNH.shape[0], q_BLNH.shape[1]
        mask = document_mask(attention_masks, batch, length, q_BLNH.device)
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
            attn_mask=mask, scale=scale, enable_gqa=enable_gqa,
        )
        return api.drop_batch_dim(out.transpose(1, 2), added)


@override(target=VarlenAttention.Config, exact=True,
          description="document-masked SDPA from varlen metadata (no Inductor; the neuron attention)")
def document_sdpa(cfg: VarlenAttention.Config) -> DocumentSDPA.Config:
    return derive(cfg, DocumentSDPA.Config)


assert f"{__name__}.{document_sdpa.__name__}" == DOCUMENT_SDPA
