"""torchtitan @override factories of the nki path; activated through `override.imports`
entries [target, {"use_nki": bool}] that pipeline.models.nki.prepare writes into the RunSpec."""

from __future__ import annotations

from torchtitan.config import derive, override
from torchtitan.models.common.moe import GroupedExperts, TokenChoiceTopKRouter
from torchtitan.models.common.rope import CosSinRoPE

from pipeline.models.nki.declarations import BY_FUNCTION
from pipeline.titan import accessors
from pipeline.models.nki.modules import NkiExperts, NkiRoPE, NkiRouter


def _fqns(name: str) -> list[str]:
    return list(BY_FUNCTION[name].fqns)


@override(target=CosSinRoPE.Config, fqns=_fqns("nki_rope"), exact=True,
          description="RoPE via pipeline_nki::rope_hf (nkilib rope_hf on neuron)")
def nki_rope(cfg: CosSinRoPE.Config, use_nki: bool = False) -> NkiRoPE.Config:
    if cfg.scaling != "none":
        raise ValueError(f"nki_rope: rope scaling {cfg.scaling!r} is not supported (plain cos/sin cache only)")
    return derive(cfg, NkiRoPE.Config, use_nki=use_nki)


@override(target=TokenChoiceTopKRouter.Config, fqns=_fqns("nki_router"), exact=True,
          description="router logits + top-k via pipeline_nki::router_topk (nkilib router_topk on neuron)")
def nki_router(cfg: TokenChoiceTopKRouter.Config, use_nki: bool = False) -> NkiRouter.Config:
    unsupported = {"score_func": cfg.score_func != "softmax", "num_expert_groups": cfg.num_expert_groups is not None,
                   "gate.bias": bool(getattr(cfg.gate, "bias", False)),
                   "_debug_force_load_balance": accessors.router_forces_load_balance(cfg)}
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"nki_router: router settings outside router_topk's contract: {bad}")
    return derive(cfg, NkiRouter.Config, use_nki=use_nki)


@override(target=GroupedExperts.Config, fqns=_fqns("nki_experts"), exact=True,
          description="expert SwiGLU via pipeline_nki::experts (nkilib moe_cte on neuron, blockwise layout)")
def nki_experts(cfg: GroupedExperts.Config, use_nki: bool = False) -> NkiExperts.Config:
    return derive(cfg, NkiExperts.Config, use_nki=use_nki)
