"""The MoE router: nki-library's `router_topk` behind the one `@nki.jit` wrap_nki needs."""

from __future__ import annotations

import nki
import nki.language as nl
from nkilib.core.router_topk.router_topk import router_topk
from nkilib.core.utils.common_types import RouterActFnType

from pipeline.models.nki.neuron_kernels import plain_function

__all__ = ["router_topk_kernel"]


@nki.jit
def router_topk_kernel(x, w, k: int, shard_on_tokens: bool):
    """router_topk is a plain function, not @nki.jit (router_topk.py); nki-library's own test calls
    it from a wrapper that allocates its outputs, and this is that wrapper (were a later nki-library to
    jit it, plain_function keeps this the only jit).

    x [T, H] and w [H, E] in one dtype (router_topk asserts it), T ≤ 2048 (its documented range; the
    caller tiles longer inputs). Returns every buffer the kernel writes, in the order router_topk
    itself returns them ("[router_logits, expert_index, expert_affinities]", its docstring):
    router_logits [T, E] float32 (the kernel accumulates in float32 and casts to the buffer's dtype;
    torchtitan's gate is float32 too), expert_index [T, K] uint32 (the kernel's index dtype, as in
    nki-library's test) and expert_affinities [T, E] in x's dtype. Softmax then top-k
    (router_pre_norm=True), as torchtitan's TokenChoiceTopKRouter with score_func="softmax".
    An output allocated here and not returned would be a kernel output wrap_nki never hands back.
    """
    tokens, experts = x.shape[0], w.shape[1]
    router_logits = nl.ndarray((tokens, experts), dtype=nl.float32, buffer=nl.shared_hbm)
    expert_affinities = nl.ndarray((tokens, experts), dtype=x.dtype, buffer=nl.shared_hbm)
    expert_index = nl.ndarray((tokens, k), dtype=nl.uint32, buffer=nl.shared_hbm)
    plain_function(router_topk)(x, w, None, router_logits, expert_affinities, expert_index,
                                act_fn=RouterActFnType.SOFTMAX, k=k, x_hbm_layout=1, x_sb_layout=0,
                                router_pre_norm=True, shard_on_tokens=shard_on_tokens)
    return router_logits, expert_index, expert_affinities
