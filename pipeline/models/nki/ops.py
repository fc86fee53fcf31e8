"""The operators the nki path calls: torch.library custom ops with fake and autograd kernels.

Each op dispatches by device: on `neuron` (and when its override was not sent to the
reference by the constraint policy, `use_nki`) it calls the NKI kernel through torch_neuronx's
wrap_nki; elsewhere it runs the PyTorch reference of the same contract — same layouts, dtypes
and outputs — so CPU training, opcheck and torch.compile exercise the exact op the trn2 graph holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.models.nki import kernels
from pipeline.models.reference import experts_reference

NAMESPACE = "pipeline_nki"


def _on_neuron(t: torch.Tensor, use_nki: bool) -> bool:
    return use_nki and t.device.type == "neuron"


# ---- rotary embedding, HF layout [B, H, S, D], packed cache [S, 2D] -------------------------

def rope_reference(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, cache_S2D: torch.Tensor,
                   backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE in float32 (as torchtitan's CosSinRoPE); backward=True applies the
    transpose rotation, which is the gradient of the forward (rope_hf's `backward` contract)."""
    head_dim = q_BHSD.shape[-1]
    cos = cache_S2D[:, :head_dim].float()
    sin = cache_S2D[:, head_dim:].float()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., : head_dim // 2], xf[..., head_dim // 2 :]
        turned = torch.cat((x2, -x1), dim=-1) if backward else torch.cat((-x2, x1), dim=-1)
        sin_used = torch.cat((sin[:, head_dim // 2 :], sin[:, : head_dim // 2]), dim=-1) if backward else sin
        return (xf * cos + turned * sin_used).to(x.dtype)

    return rotate(q_BHSD), rotate(k_BHSD)


@torch.library.custom_op(f"{NAMESPACE}::rope_hf", mutates_args=())
def rope_hf(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, cache_S2D: torch.Tensor, backward: bool,
            use_nki: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_neuron(q_BHSD, use_nki):
        q_out, k_out = torch.empty_like(q_BHSD), torch.empty_like(k_BHSD)
        kernels.rope_hf()[kernels.lnc()](q_BHSD, k_BHSD, q_out, k_out, rope_cache=cache_S2D.to(q_BHSD.dtype),
                                         backward=backward)
        return q_out, k_out
    q, k = rope_reference(q_BHSD, k_BHSD, cache_S2D, backward)
    return q, k


@rope_hf.register_fake
def _(q_BHSD, k_BHSD, cache_S2D, backward, use_nki):
    return torch.empty_like(q_BHSD), torch.empty_like(k_BHSD)


def _rope_setup(ctx, inputs, output):
    _, _, cache_S2D, backward, use_nki = inputs
    ctx.save_for_backward(cache_S2D)
    ctx.backward, ctx.use_nki = backward, use_nki


def _rope_backward(ctx, grad_q, grad_k):
    (cache_S2D,) = ctx.saved_tensors
    # The rotation is linear: its gradient is the same kernel in the other direction.
    dq, dk = rope_hf(grad_q.contiguous(), grad_k.contiguous(), cache_S2D, not ctx.backward, ctx.use_nki)
    return dq, dk, None, None, None


rope_hf.register_autograd(_rope_backward, setup_context=_rope_setup)


# ---- router: logits [T, E] (float32) and top-k expert ids [T, K] ----------------------------

def router_reference(x_TH: torch.Tensor, w_EH: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    logits = x_TH.float() @ w_EH.float().T
    ids = torch.topk(F.softmax(logits, dim=-1), k=top_k, dim=-1, sorted=False).indices
    return logits, ids


@torch.library.custom_op(f"{NAMESPACE}::router_topk", mutates_args=())
def router_topk(x_TH: torch.Tensor, w_EH: torch.Tensor, top_k: int, use_nki: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if _on_neuron(x_TH, use_nki):
        from nkilib.core.utils.common_types import RouterActFnType

        tokens, experts = x_TH.shape[0], w_EH.shape[0]
        logits = x_TH.new_empty(tokens, experts, dtype=torch.float32)
        affinities = x_TH.new_empty(tokens, experts)
        ids = x_TH.new_empty(tokens, top_k, dtype=torch.int32)
        kernels.router_topk()[kernels.lnc()](
            x_TH.contiguous(), w_EH.to(x_TH.dtype).T.contiguous(), None, logits, affinities, ids,
            act_fn=RouterActFnType.SOFTMAX, k=top_k, x_hbm_layout=1, x_sb_layout=0,
        )
        return logits, ids.long()
    logits, ids = router_reference(x_TH, w_EH, top_k)
    return logits, ids


@router_topk.register_fake
def _(x_TH, w_EH, top_k, use_nki):
    tokens, experts = x_TH.shape[0], w_EH.shape[0]
    return x_TH.new_empty(tokens, experts, dtype=torch.float32), x_TH.new_empty(tokens, top_k, dtype=torch.long)


def _router_setup(ctx, inputs, output):
    x_TH, w_EH, _, _ = inputs
    ctx.save_for_backward(x_TH, w_EH)


def _router_backward(ctx, grad_logits, _grad_ids):
    x_TH, w_EH = ctx.saved_tensors
    # logits = x @ wᵀ in float32: two matmuls, cheap enough that a backward kernel buys nothing.
    grad_x = (grad_logits @ w_EH.float()).to(x_TH.dtype)
    grad_w = (grad_logits.T @ x_TH.float()).to(w_EH.dtype)
    return grad_x, grad_w, None, None


router_topk.register_autograd(_router_backward, setup_context=_router_setup)


# ---- experts: SwiGLU per expert over expert-sorted tokens -----------------------------------

@torch.library.custom_op(f"{NAMESPACE}::experts", mutates_args=())
def experts(x_RD: torch.Tensor, tokens_per_expert_E: torch.Tensor, w1_EFD: torch.Tensor, w2_EDF: torch.Tensor,
            w3_EFD: torch.Tensor, use_nki: bool) -> torch.Tensor:
    # moe_cte (nkilib) is the kernel meant for `neuron`; its entry point needs the blockwise
    # token layout (token_position_to_id) that is not built here yet, so every device runs the
    # reference (on neuron, compiled by neuronx-cc). The override still checks moe_cte's rules on
    # trn2 so a config that could never take the kernel is refused now, not after binding it.
    return experts_reference(x_RD, tokens_per_expert_E, w1_EFD, w2_EDF, w3_EFD).clone()


@experts.register_fake
def _(x_RD, tokens_per_expert_E, w1_EFD, w2_EDF, w3_EFD, use_nki):
    return torch.empty_like(x_RD)


def _experts_setup(ctx, inputs, output):
    x_RD, counts, w1, w2, w3, _ = inputs
    ctx.save_for_backward(x_RD, counts, w1, w2, w3)


def _experts_backward(ctx, grad_out):
    x_RD, counts, w1, w2, w3 = ctx.saved_tensors
    # Reference backward: recompute the forward with autograd and differentiate it (no
    # activations kept between passes, like moe_cte's checkpointing mode).
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (x_RD, w1, w2, w3)]
        out = experts_reference(leaves[0], counts, *leaves[1:])
        grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves)]
    return grads[0], None, grads[1], grads[2], grads[3], None


experts.register_autograd(_experts_backward, setup_context=_experts_setup)
