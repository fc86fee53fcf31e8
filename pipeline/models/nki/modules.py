"""Replacement modules: torchtitan's own classes with forward routed through our custom ops.

Each subclasses the module it replaces and adds no parameters or buffers, so state-dict keys,
checkpoints and the HF export stay exactly native's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchtitan.models.common.moe import GroupedExperts, TokenChoiceTopKRouter
from torchtitan.models.common.rope import CosSinRoPE

from pipeline.models.nki import adapters, ops
from pipeline.titan import api


class NkiRoPE(CosSinRoPE):
    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        use_nki: bool = False

    @api.forward_signature_of(CosSinRoPE.forward)
    def forward(self, query, key, positions=None):
        (q_BSHD, k_BSHD), added = api.with_batch_dim(4, adapters.local(query), adapters.local(key))
        positions_BS = adapters.local(positions)
        if added and positions_BS is not None:
            positions_BS = positions_BS.unsqueeze(0)
        cache = adapters.rope_cache_for(adapters.local(self.cache), q_BSHD.shape[0], q_BSHD.shape[1], positions_BS)
        q, k = ops.rope_hf(adapters.bshd_to_bhsd(q_BSHD), adapters.bshd_to_bhsd(k_BSHD), cache, False,
                           self.config.use_nki)
        q, k = (api.drop_batch_dim(adapters.bhsd_to_bshd(t), added) for t in (q, k))
        return adapters.like(query, q), adapters.like(key, k)


class NkiRouter(TokenChoiceTopKRouter):
    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        use_nki: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        self.use_nki = config.use_nki

    @api.forward_signature_of(TokenChoiceTopKRouter.forward)
    def forward(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        if expert_bias_E is not None:
            raise NotImplementedError("nki_router: expert-bias routing is not in router_topk's contract")
        x_local = adapters.local(x_BLD)
        leading = x_local.shape[:-1]  # [B, L] on torchtitan 0.3.0, [T] on main (titan.api)
        logits_TE, ids_TK = ops.router_topk(adapters.tokens(x_local), adapters.local(self.gate.weight), self.top_k,
                                            self.use_nki)
        scores_TE = F.softmax(logits_TE, dim=-1)
        topk_scores_TK = scores_TE.gather(dim=-1, index=ids_TK)
        if self.route_norm:
            topk_scores_TK = topk_scores_TK / (topk_scores_TK.sum(dim=-1, keepdim=True) + 1e-20)
        topk_scores_TK = topk_scores_TK * self.route_scale
        return tuple(adapters.like(x_BLD, t.view(*leading, -1)) for t in (topk_scores_TK, ids_TK, scores_TE))


class NkiExperts(GroupedExperts):
    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        use_nki: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        self.use_nki = config.use_nki

    @api.forward_signature_of(GroupedExperts.forward)
    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        weights = [adapters.local(w) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD)]
        return ops.experts(x_RD, num_tokens_per_expert_E, *weights, self.use_nki)
