"""Model overrides that only CPU needs, attached through torchtitan's override registry.

- `dense_mask_attention`: FlexAttention has no CPU backward (torch 2.14), and it is the only
  attention torchtitan offers language models. The replacement turns the same block-causal
  BlockMask into a dense boolean mask and calls scaled_dot_product_attention: same math. Every
  layer gets the same BlockMask in one forward: the dense mask is made once, by evaluating
  mask_mod on broadcast index tensors (create_mask's vmap costs more than the attention here).
- `loop_experts`: GroupedExperts always runs torch._grouped_mm in bfloat16; on CPU that is
  slow and, worse, not float32, so fp32 losses could not match Hugging Face's. The
  replacement runs each expert's SwiGLU in the input dtype (`pipeline.models.reference.experts_reference`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.nn.attention.flex_attention import create_mask
from torchtitan.config import derive, override
from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.common.moe import GroupedExperts

from pipeline.models.reference import experts_reference
from pipeline.titan import api


def dense_mask(block_mask, batch: int, length: int, device) -> torch.Tensor:
    """[B, 1, L, L] bool of a BlockMask's mask_mod, made once per BlockMask (kept on it)."""
    cached = getattr(block_mask, "pipeline_dense_mask", None)  # an attribute of ours on that BlockMask
    if cached is not None and cached.shape == (batch, 1, length, length):
        return cached
    idx = lambda *shape: torch.arange(max(shape), device=device).view(shape)  # noqa: E731
    try:
        # Element-wise mask_mods (causal, packed documents, and_masks of them) broadcast as they are.
        mask = block_mask.mask_mod(idx(batch, 1, 1, 1), idx(1, 1, 1, 1), idx(1, 1, length, 1), idx(1, 1, 1, length))
        mask = mask.expand(batch, 1, length, length) if mask.dtype == torch.bool else None
    except (RuntimeError, IndexError, TypeError):
        mask = None
    if mask is None:  # a mask_mod that does not broadcast: the general (vmap) way
        mask = create_mask(block_mask.mask_mod, batch, None, length, length, device=device)
    block_mask.pipeline_dense_mask = mask
    return mask


class DenseMaskAttention(FlexAttention):
    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    @api.forward_signature_of(FlexAttention.forward)
    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, score_mod=None, scale=None,
                enable_gqa=False, out_transform=None, **kwargs):
        if score_mod is not None or out_transform is not None:
            raise NotImplementedError("dense_mask_attention supports plain masked attention only")
        (q_BLNH, k_BLNH, v_BLNH), added = api.with_batch_dim(4, q_BLNH, k_BLNH, v_BLNH)
        mask = dense_mask(attention_masks, q_BLNH.shape[0], q_BLNH.shape[1], q_BLNH.device)
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
            attn_mask=mask, scale=scale, enable_gqa=enable_gqa,
        )
        return api.drop_batch_dim(out.transpose(1, 2), added)


class LoopExperts(GroupedExperts):
    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass

    @api.forward_signature_of(GroupedExperts.forward)
    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        weights = [w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)]
        return experts_reference(x_RD, num_tokens_per_expert_E, *weights)


@override(target=FlexAttention.Config, description="dense-mask SDPA (FlexAttention has no CPU backward)", exact=True)
def dense_mask_attention(cfg: FlexAttention.Config) -> DenseMaskAttention.Config:
    return derive(cfg, DenseMaskAttention.Config)


@override(target=GroupedExperts.Config, description="per-expert loop in the input dtype", exact=True)
def loop_experts(cfg: GroupedExperts.Config) -> LoopExperts.Config:
    return derive(cfg, LoopExperts.Config)
