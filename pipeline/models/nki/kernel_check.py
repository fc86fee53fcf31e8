"""Every nki override against an independent implementation, in float32 (stage `verify-kernels`).

Each case draws seeded float32 inputs at shapes its kernel accepts on trn2 at the target's LNC
(RoPE's sequence a multiple of 128 × LNC; the router beyond router_topk's 2048-token range, which
the op tiles; experts inside moe_cte's ranges) and compares the replacement's outputs and input and
weight gradients with an implementation that shares no code with it, run in float32:
- nki_rope vs torchtitan's CosSinRoPE, with packed per-document positions (as training gives them);
- nki_router vs torchtitan's TokenChoiceTopKRouter, the module it replaces;
- nki_experts (inside torchtitan's RoutedExperts: dispatch, experts, combine) vs transformers' own
  Qwen3MoeExperts (per-expert SwiGLU over the same routing).
The replacement runs at each --dtypes dtype (the same float32 values, cast); a row passes when its
largest error relative to the reference's largest magnitude is within the threshold of the
precision it computed in. Any FAIL row exits non-zero. The NKI kernels run where `nki` imports
(trn2: device `neuron`); elsewhere the table says so and checks each op's reference dispatch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.dtypes import DTYPES
from pipeline.models.nki.kernels import KernelUnavailable

# max error relative to the reference's largest magnitude, by the precision the replacement computed in
THRESHOLDS = {d.name: d.kernel for d in DTYPES.values()}
# moe_cte computes in bfloat16 whatever its inputs (compute_dtype default, moe_cte.py)
KERNEL_COMPUTE_DTYPE = {"moe_cte": "bfloat16"}
# Below float32 the top-k *choice* among near-equal scores is not defined (rounding reorders near
# ties), so those rows compare the quantities that do not depend on it.
CHOICE_DEPENDENT = {"topk_scores", "ids", "dx", "dgate"}


@dataclass(frozen=True)
class Case:
    override: str
    kernel: str
    shape: str
    reference_name: str
    inputs: Callable  # (seed) -> {name: float32 tensor}
    replacement: Callable  # (inputs, dtype, device, use_nki) -> {name: tensor}
    reference: Callable  # (inputs) -> {name: float32 tensor}
    dims: dict  # the quantities constraints.KERNEL_RULES[kernel] checks, at this shape


def _gen(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


def _leaf(t, dtype, device):
    """A fresh copy that collects its own gradient (never the shared input itself)."""
    return t.detach().to(device=device, dtype=dtype, copy=True).requires_grad_(True)


# ---- RoPE --------------------------------------------------------------------------------------

def _packed_positions(batch: int, seq: int, gen):
    """Per-row positions of packed documents, each restarting at 0 (torchtitan's HF loader)."""
    import torch

    rows = []
    for _ in range(batch):
        cuts = sorted(torch.randperm(seq - 1, generator=gen)[:3].add(1).tolist())
        rows.append(torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, seq])]))
    return torch.stack(rows)


def _rope_case(b: int, s: int, hq: int, hkv: int, d: int, lnc: int, theta: float = 5e6) -> Case:
    def inputs(seed):
        import torch

        gen = _gen(seed)
        return {"q": torch.randn(b, s, hq, d, generator=gen), "k": torch.randn(b, s, hkv, d, generator=gen),
                "gq": torch.randn(b, s, hq, d, generator=gen), "gk": torch.randn(b, s, hkv, d, generator=gen),
                "positions": _packed_positions(b, s, gen)}

    def run(cls, extra, inp, dtype, device):
        import torch

        from pipeline.titan import api, model_spec

        mod = cls(model_spec.rope_config(cls, dim=d, max_len=s, theta=theta, **extra)).to(device)
        leaves = {n: _leaf(inp[n], dtype, device) for n in ("q", "k")}
        # torchtitan main's RoPE takes [T, H, D] packed tokens (#4121): the same rows, folded.
        fold = (lambda t: t.flatten(0, 1)) if api.folded_batch() else (lambda t: t)
        unfold = (lambda t: t.unflatten(0, (b, s))) if api.folded_batch() else (lambda t: t)
        oq, ok = (unfold(t) for t in mod(fold(leaves["q"]), fold(leaves["k"]), fold(inp["positions"].to(device))))
        torch.autograd.backward([oq, ok], [inp["gq"].to(device, dtype), inp["gk"].to(device, dtype)])
        return {"q": oq, "k": ok, "dq": leaves["q"].grad, "dk": leaves["k"].grad}

    def replacement(inp, dtype, device, use_nki):
        from pipeline.models.nki.modules import NkiRoPE

        return run(NkiRoPE, {"use_nki": use_nki}, inp, dtype, device)

    def reference(inp):
        import torch
        from torchtitan.models.common.rope import CosSinRoPE

        return run(CosSinRoPE, {}, inp, torch.float32, "cpu")

    return Case("nki_rope", "rope_hf", f"B{b} S{s} H{hq}/{hkv} D{d} packed", "torchtitan CosSinRoPE", inputs,
                replacement, reference, {"seq_len": s, "rope_multiple": 128 * lnc})


# ---- router ------------------------------------------------------------------------------------

def _router_case(t: int, d: int, e: int, k: int) -> Case:
    def inputs(seed):
        import torch

        gen = _gen(seed)
        return {"x": torch.randn(1, t, d, generator=gen), "gate": torch.randn(e, d, generator=gen) * d ** -0.5,
                "gscores": torch.randn(1, t, e, generator=gen)}

    def run(cls, extra, inp, dtype, device):
        import torch
        from torchtitan.models.common import Linear

        cfg = cls.Config(num_experts=e, gate=Linear.Config(in_features=d, out_features=e), top_k=k,
                         score_func="softmax", route_norm=True, **extra)
        mod = cls(cfg)
        with torch.no_grad():
            mod.gate.weight.copy_(inp["gate"])
        mod = mod.to(device, dtype)
        x = _leaf(inp["x"], dtype, device)
        scores, ids, full = mod(x)
        order = ids.sort(dim=-1)  # the top-k set, in expert order (top-k order is unspecified)
        picked = scores.gather(-1, order.indices)
        loss = (picked * torch.arange(1, k + 1, device=device)).sum() + (full * inp["gscores"].to(device, full.dtype)).sum()
        loss.backward()
        return {"topk_scores": picked, "ids": order.values, "scores": full, "dx": x.grad, "dgate": mod.gate.weight.grad}

    def replacement(inp, dtype, device, use_nki):
        from pipeline.models.nki.modules import NkiRouter

        return run(NkiRouter, {"use_nki": use_nki}, inp, dtype, device)

    def reference(inp):
        import torch
        from torchtitan.models.common.moe import TokenChoiceTopKRouter

        return run(TokenChoiceTopKRouter, {}, inp, torch.float32, "cpu")

    return Case("nki_router", "router_topk", f"T{t} D{d} E{e} K{k}", "torchtitan TokenChoiceTopKRouter", inputs,
                replacement, reference, {"top_k": k, "num_experts": e, "hidden": d, "tokens": t})


# ---- experts -----------------------------------------------------------------------------------

def _experts_case(t: int, k: int, d: int, f: int, e: int) -> Case:
    def inputs(seed):
        import torch

        gen = _gen(seed)
        # uneven loads: expert popularity from a skewed distribution, the last expert never chosen
        popularity = torch.rand(e, generator=gen) ** 3
        popularity[-1] = 0
        ids = torch.multinomial(popularity.expand(t, e), k, replacement=False, generator=gen)
        return {"x": torch.randn(1, t, d, generator=gen), "ids": ids.view(1, t, k),
                "scores": torch.rand(1, t, k, generator=gen), "w1": torch.randn(e, f, d, generator=gen) * d ** -0.5,
                "w2": torch.randn(e, d, f, generator=gen) * f ** -0.5, "w3": torch.randn(e, f, d, generator=gen) * d ** -0.5,
                "gout": torch.randn(1, t, d, generator=gen)}

    def replacement(inp, dtype, device, use_nki):
        import torch
        from torchtitan.models.common.moe import RoutedExperts
        from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

        from pipeline.models.nki.modules import NkiExperts

        mod = RoutedExperts(RoutedExperts.Config(
            inner_experts=NkiExperts.Config(dim=d, hidden_dim=f, num_experts=e, use_nki=use_nki),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=e, top_k=k)))
        experts = mod.inner_experts
        with torch.no_grad():
            for name in ("w1", "w2", "w3"):
                getattr(experts, f"{name}_{'EDF' if name == 'w2' else 'EFD'}").copy_(inp[name])
        mod = mod.to(device, dtype)
        x = _leaf(inp["x"], dtype, device)
        ids = inp["ids"].to(device)
        counts = torch.zeros(1, t, e, dtype=torch.bool, device=device).scatter_(-1, ids, True).sum(dim=(0, 1))
        from pipeline.titan import api

        # torchtitan main's MoE takes [T, …] tokens (#4121): the one row, folded.
        fold = (lambda v: v.flatten(0, 1)) if api.folded_batch() else (lambda v: v)
        out = mod(fold(x), fold(inp["scores"].to(device, torch.float32)), fold(ids), counts).view(1, t, d)
        out.backward(inp["gout"].to(device, dtype))
        return {"out": out, "dx": x.grad, "dw1": experts.w1_EFD.grad, "dw2": experts.w2_EDF.grad,
                "dw3": experts.w3_EFD.grad}

    def reference(inp):
        import torch
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        config = Qwen3MoeConfig(hidden_size=d, moe_intermediate_size=f, num_experts=e, num_experts_per_tok=k,
                                hidden_act="silu")
        config._experts_implementation = "eager"  # transformers' own per-expert loop
        mod = Qwen3MoeExperts(config)
        with torch.no_grad():
            mod.gate_up_proj.copy_(torch.cat([inp["w1"], inp["w3"]], dim=1))
            mod.down_proj.copy_(inp["w2"])
        x = _leaf(inp["x"].view(t, d), torch.float32, "cpu")
        out = mod(x, inp["ids"].view(t, k), inp["scores"].view(t, k))
        out.backward(inp["gout"].view(t, d))
        gate_up = mod.gate_up_proj.grad
        return {"out": out.view(1, t, d), "dx": x.grad.view(1, t, d), "dw1": gate_up[:, :f], "dw2": mod.down_proj.grad,
                "dw3": gate_up[:, f:]}

    return Case("nki_experts", "moe_cte", f"T{t} K{k} D{d} F{f} E{e}", "transformers Qwen3MoeExperts", inputs,
                replacement, reference, {"hidden": d, "intermediate_per_tp_rank": f, "experts_per_rank": e,
                                         "routed_rows_per_rank": t * k})


def cases(lnc: int) -> list[Case]:
    """Shapes every kernel accepts on trn2 at this LNC (constraints.KERNEL_RULES)."""
    from pipeline.models.nki.constraints import ROUTER_MAX_TOKENS

    seq = 128 * lnc
    return [
        _rope_case(2, seq, 4, 2, 128, lnc), _rope_case(1, 2 * seq, 8, 4, 64, lnc),
        _router_case(256, 512, 64, 8), _router_case(ROUTER_MAX_TOKENS + 256, 256, 16, 2),
        _experts_case(256, 2, 512, 2048, 8),
    ]


def _errors(got: dict, ref: dict, compute_dtype: str) -> tuple[float, float]:
    worst_abs = worst_rel = 0.0
    for name, value in ref.items():
        if compute_dtype != "float32" and name in CHOICE_DEPENDENT:
            continue
        diff = (got[name].double().cpu() - value.double()).abs().max().item()
        scale = max(value.double().abs().max().item(), 1e-12)
        worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, diff / scale)
    return worst_abs, worst_rel


def verify(all_cases: list[Case], dtypes: list[str], device: str = "cpu", use_nki: bool = False,
           seed: int = 1234) -> list[dict]:
    import torch

    rows = []
    for case in all_cases:
        inputs = case.inputs(seed)
        reference = case.reference(inputs)
        for dtype_name in dtypes:
            compute = dtype_name
            if use_nki and KERNEL_COMPUTE_DTYPE.get(case.kernel) == "bfloat16":
                compute = "bfloat16"
            row = {"override": case.override, "shape": case.shape, "dtype": dtype_name,
                   "runs": case.kernel if use_nki else "reference", "vs": f"{case.reference_name} (float32)",
                   "threshold": THRESHOLDS[compute]}
            try:
                got = case.replacement(inputs, getattr(torch, dtype_name), device, use_nki)
            except KernelUnavailable as err:  # this kernel's row fails; every other kernel is still checked
                rows.append({**row, "max_abs": math.nan, "max_rel": math.nan, "pass": False, "error": err.problem})
                continue
            err_abs, err_rel = _errors(got, reference, compute)
            rows.append({**row, "max_abs": err_abs, "max_rel": err_rel, "pass": err_rel <= THRESHOLDS[compute]})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'override':<12} {'shape':<24} {'dtype':<9} {'runs':<12} {'vs':<44} {'max abs':>9} {'max rel':>9} "
            f"{'thresh':>7}  ok")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['override']:<12} {r['shape']:<24} {r['dtype']:<9} {r['runs']:<12} {r['vs']:<44} "
                     f"{r['max_abs']:>9.2e} {r['max_rel']:>9.2e} {r['threshold']:>7.0e}  {'PASS' if r['pass'] else 'FAIL'}"
                     + (f"  {r['error']}" if r.get("error") else ""))
    return "\n".join(lines)


