"""The NKI entry points `torch_neuronx.wrap_nki` takes; importable only in the Neuron image.

wrap_nki reads a jitted kernel's `.func` and signature (torch_neuronx nki_hop.py), so each entry is
an `nki.jit` kernel whose arguments are tensors or plain constants. Kernel code stays in nki-library
(nkilib, bundled with neuronx-cc); the float32 references these are checked against live beside the
callers: `ops.rope_reference`, `ops.router_reference`, `layout.moe_cte_reference`.
"""

from __future__ import annotations

import nki
import nki.language as nl
from nkilib.core.embeddings.rope_hf import rope_hf  # already @nki.jit (rope_hf.py)
from nkilib.core.moe.moe_cte.moe_cte import MoECTEImplementation, MoECTESpec, moe_cte
from nkilib.core.router_topk.router_topk import router_topk
from nkilib.core.utils.common_types import RouterActFnType

__all__ = ["rope_hf", "router_topk_kernel", "moe_cte_shard_on_i"]


@nki.jit
def router_topk_kernel(x, w, k: int, shard_on_tokens: bool):
    """router_topk is a plain function, not @nki.jit (router_topk.py); nki-library's own test calls
    it from a wrapper that allocates its outputs, and this is that wrapper.

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
    router_topk(x, w, None, router_logits, expert_affinities, expert_index, act_fn=RouterActFnType.SOFTMAX,
                k=k, x_hbm_layout=1, x_sb_layout=0, router_pre_norm=True, shard_on_tokens=shard_on_tokens)
    return router_logits, expert_index, expert_affinities


@nki.jit(mode="trace")
def moe_cte_shard_on_i(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                       token_position_to_id, block_to_expert, block_size: int):
    """moe_cte (core/moe/moe_cte/moe_cte.py, @nki.jit(mode="trace")) with its spec built inside the
    trace, so wrap_nki passes only tensors and ints. shard_on_I: every block on both cores, the
    intermediate dimension split between them (LNC=2); no block-count rounding needed.
    Shapes: hidden [T+1, H] (row T the zero padding token), affinities [(T+1)·E, 1], gate_up
    [E, H, 2, I], down [E, I, H], token_position_to_id [N·B] int32, block_to_expert [N, 1] int32.
    """
    return moe_cte(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                   token_position_to_id, block_to_expert, block_size,
                   MoECTESpec(implementation=MoECTEImplementation.shard_on_i), is_tensor_update_accumulating=True)
