"""The operators the nki path calls: custom ops with fake and autograd registrations.

Each op runs its NKI kernel on `neuron` (unless the constraint policy sent its override to the
reference: `use_nki=False`) and elsewhere its PyTorch reference of the same contract — same layouts,
dtypes and outputs — so CPU training, opcheck and torch.compile exercise the op the trn2 graph holds.

Registration: where torch_neuronx imports, through its `nki_op`, which registers the function as a
custom op *and* as the op's decomposition under functionalization, so torch.compile(backend="neuron")
traces through it to the wrap_nki call (neuron:torch/guides/how-to-work-with-nki.html: AWS documents
nki_op as the way to use an NKI kernel under torch.compile; docs/sources.md). Elsewhere through torch.library.custom_op. Either way the function is
its own fake kernel (what nki_op does), so each body is written to be traceable: static shapes, no
host syncs.

COUNTS records real (non-fake) invocations per op; with PIPELINE_NKI_OP_COUNTS=<dir> set, each
process that counted any writes them to <dir>/rank<RANK>.json at exit (tests prove the path ran). Under
torch.compile on neuron the bodies run only while tracing, so counts there mean nothing.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline import envvars
from pipeline.models.nki import kernels
from pipeline.models.nki.constraints import MOE_BLOCK_SIZE, ROUTER_MAX_TOKENS
from pipeline.models.nki.layout import blockwise_layout, moe_cte_inputs, moe_cte_reference, moe_cte_reference_backward

NAMESPACE = "pipeline_nki"
COUNTS: collections.Counter = collections.Counter()
COUNTS_DIR_ENV = envvars.NKI_OP_COUNTS


def _count(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch._subclasses.FakeTensor):
        COUNTS[name] += 1


def _write_counts() -> None:
    directory = os.environ.get(COUNTS_DIR_ENV)
    if directory and COUNTS:  # the launcher imports this module too, and counts nothing
        name = f"rank{os.environ['RANK']}" if "RANK" in os.environ else f"pid{os.getpid()}"
        Path(directory).mkdir(parents=True, exist_ok=True)
        Path(directory, f"{name}.json").write_text(json.dumps(dict(COUNTS)))


atexit.register(_write_counts)


def _register(name: str, fn):
    qualname = f"{NAMESPACE}::{name}"
    if kernels.nki_unavailable_reason() is None:
        from torch_neuronx import nki_op

        return nki_op(qualname, fn, mutates_args=())
    op = torch.library.custom_op(qualname, fn, mutates_args=())
    op.register_fake(fn)
    return op


def _on_neuron(t: torch.Tensor, use_nki: bool) -> bool:
    return use_nki and t.device.type == "neuron"


# ---- rotary embedding: HF layout [B, H, S, D], packed cos|sin cache [S, 2D] or [B, S, 2D] -------

def rope_reference(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, cache: torch.Tensor,
                   backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE in float32, exactly as torchtitan's CosSinRoPE computes it; backward=True
    applies the transposed rotation, the gradient of the forward (rope_hf's `backward` contract:
    [x1, x2]·cos + [x2, -x1]·[sin2, sin1])."""
    head_dim = q_BHSD.shape[-1]
    half = head_dim // 2
    cos, sin = cache[..., :head_dim].float(), cache[..., head_dim:].float()
    if cache.dim() == 3:  # one cache per batch row: broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if backward:
        sin = torch.cat((sin[..., half:], sin[..., :half]), dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:]
        turned = torch.cat((x2, -x1), dim=-1) if backward else torch.cat((-x2, x1), dim=-1)
        return (xf * cos + turned * sin).to(x.dtype)

    return rotate(q_BHSD), rotate(k_BHSD)


def _rope(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, cache: torch.Tensor, backward: bool,
          use_nki: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _count("rope_hf.backward" if backward else "rope_hf.forward", q_BHSD)
    if _on_neuron(q_BHSD, use_nki):
        # rope_hf loads cos/sin tiles in q's dtype and rotates in it (rope_hf.py).
        q_out, k_out = kernels.launch("rope_hf")(q_BHSD, k_BHSD, torch.empty_like(q_BHSD), torch.empty_like(k_BHSD),
                                                 rope_cache=cache.to(q_BHSD.dtype).contiguous(), backward=backward)
        return q_out, k_out
    return rope_reference(q_BHSD, k_BHSD, cache, backward)


rope_hf = _register("rope_hf", _rope)


def _rope_setup(ctx, inputs, output):
    _, _, cache, backward, use_nki = inputs
    ctx.save_for_backward(cache)
    ctx.backward, ctx.use_nki = backward, use_nki


def _rope_backward(ctx, grad_q, grad_k):
    (cache,) = ctx.saved_tensors
    # The rotation is linear and orthogonal: its gradient is the same kernel turning the other way.
    dq, dk = rope_hf(grad_q.contiguous(), grad_k.contiguous(), cache, not ctx.backward, ctx.use_nki)
    return dq, dk, None, None, None


rope_hf.register_autograd(_rope_backward, setup_context=_rope_setup)


# ---- router: logits [T, E] float32 and top-k expert ids [T, K] -----------------------------

def router_reference(x_TH: torch.Tensor, w_EH: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchtitan's gate (float32 under autocast) and its softmax top-k choice."""
    logits = F.linear(x_TH.float(), w_EH.float())
    ids = torch.topk(F.softmax(logits, dim=-1), k=top_k, dim=-1, sorted=False).indices
    return logits, ids


def router_tiled(x_TH: torch.Tensor, w_HE: torch.Tensor, top_k: int, kernel, max_tokens: int = ROUTER_MAX_TOKENS):
    """router_topk is built for T ≤ 2048 (router_topk.py docstring; it keeps x and its float32
    intermediates for all T in SBUF): longer inputs go through it in chunks of ≤ max_tokens tokens.
    `kernel(x_chunk, w_HE, top_k)` returns what router_topk writes: float32 logits, uint32 ids and
    the affinities. The op's contract is logits and ids: the router's scores are softmax(logits)
    in float32 (torchtitan's), and nki-library describes the affinities two ways (the full softmax in
    router_topk_torch.py; the top-k scattered over E in router_topk.py's pseudocode), so they are
    not read."""
    logits, ids = [], []
    for start in range(0, x_TH.shape[0], max_tokens):
        chunk_logits, chunk_ids, _affinities = kernel(x_TH[start:start + max_tokens].contiguous(), w_HE, top_k)
        logits.append(chunk_logits)
        ids.append(chunk_ids.to(torch.int64))
    return torch.cat(logits), torch.cat(ids)


def _router_kernel(x_TH: torch.Tensor, w_HE: torch.Tensor, top_k: int):
    lnc = kernels.lnc()
    # shard_on_tokens splits T between the LNC=2 cores; it needs T even (router_topk.py).
    return kernels.launch("router_topk_kernel")(x_TH, w_HE, top_k, lnc > 1 and x_TH.shape[0] % 2 == 0)


def _router(x_TH: torch.Tensor, w_EH: torch.Tensor, top_k: int, use_nki: bool) -> tuple[torch.Tensor, torch.Tensor]:
    _count("router_topk.forward", x_TH)
    if _on_neuron(x_TH, use_nki):
        # router_topk asserts x.dtype == w.dtype and takes w as [H, E].
        return router_tiled(x_TH, w_EH.to(x_TH.dtype).T.contiguous(), top_k, _router_kernel)
    return router_reference(x_TH, w_EH, top_k)


router_topk = _register("router_topk", _router)


def _router_setup(ctx, inputs, output):
    x_TH, w_EH, _, _ = inputs
    ctx.save_for_backward(x_TH, w_EH)


def _router_backward(ctx, grad_logits, _grad_ids):
    x_TH, w_EH = ctx.saved_tensors
    _count("router_topk.backward", x_TH)
    # logits = x @ wᵀ in float32: two matmuls, cheap enough that a backward kernel buys nothing.
    grad_x = (grad_logits @ w_EH.float()).to(x_TH.dtype)
    grad_w = (grad_logits.T @ x_TH.float()).to(w_EH.dtype)
    return grad_x, grad_w, None, None


router_topk.register_autograd(_router_backward, setup_context=_router_setup)


# ---- experts: SwiGLU per expert over expert-sorted rows, through moe_cte's block layout -----

def experts_blockwise(x_RD: torch.Tensor, tokens_per_expert_E: torch.Tensor, w1_EFD: torch.Tensor,
                      w2_EDF: torch.Tensor, w3_EFD: torch.Tensor, kernel=None) -> torch.Tensor:
    """The experts' output [R, D]: moe_cte's inputs built from torchtitan's, then `kernel` (the
    wrap_nki caller) or moe_cte_reference over them, and the R row outputs back."""
    rows = x_RD.shape[0]
    layout = blockwise_layout(tokens_per_expert_E, rows, MOE_BLOCK_SIZE)
    inputs = moe_cte_inputs(x_RD, w1_EFD, w2_EDF, w3_EFD, layout)
    out = (kernel or moe_cte_reference)(**inputs, block_size=MOE_BLOCK_SIZE)
    return out[:rows]


def _experts(x_RD: torch.Tensor, tokens_per_expert_E: torch.Tensor, w1_EFD: torch.Tensor, w2_EDF: torch.Tensor,
             w3_EFD: torch.Tensor, use_nki: bool) -> torch.Tensor:
    _count("experts.forward", x_RD)
    kernel = kernels.launch("moe_cte_shard_on_i") if _on_neuron(x_RD, use_nki) else None
    return experts_blockwise(x_RD, tokens_per_expert_E, w1_EFD, w2_EDF, w3_EFD, kernel).clone()


experts = _register("experts", _experts)


def _experts_setup(ctx, inputs, output):
    x_RD, counts, w1, w2, w3, _ = inputs
    ctx.save_for_backward(x_RD, counts, w1, w2, w3)


def _experts_backward(ctx, grad_out):
    x_RD, counts, w1, w2, w3 = ctx.saved_tensors
    _count("experts.backward", x_RD)
    # Backward = the reference's gradient over the same layout, block by block from the row indices
    # (layout.moe_cte_reference_backward: weight-sized accumulators, no per-block weight copies), on
    # every device. nki-library's blockwise backward (nkilib/experimental/moe/bwd/blockwise_mm_backward.py)
    # is experimental (its usage range is still a TODO there), needs the forward run with
    # checkpoint_activation=True to keep [N, 2, I, B] and [N, B, H] activations per layer until the
    # backward, and reads hidden states as [T, H] where the forward takes [T+1, H]: not something to
    # bind without a trn2 to validate it on. The recompute costs one more forward's FLOPs.
    grad_x, grad_w1, grad_w2, grad_w3 = moe_cte_reference_backward(x_RD, counts, w1, w2, w3, grad_out.contiguous(),
                                                                   MOE_BLOCK_SIZE)
    return grad_x, None, grad_w1, grad_w2, grad_w3, None


experts.register_autograd(_experts_backward, setup_context=_experts_setup)
