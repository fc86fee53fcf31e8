"""Stage `verify-kernels`: every nki override vs the module it replaces and vs float32.

For each override, on fresh random inputs of several valid shapes and each dtype: forward
outputs and input/weight gradients of the replacement module against torchtitan's module it
replaces (same dtype) and against that module run in float32. Prints a table of max abs / max
rel error with the pass threshold per dtype; a failing row is a non-zero exit. The NKI kernels
themselves run only where `nki` imports (trn2 or the NKI simulator); elsewhere the table says so
and the reference dispatch of the same operators is what gets checked.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.errors import PipelineError

# max error relative to the reference's largest magnitude, per dtype of the checked run
THRESHOLDS = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclass(frozen=True)
class Case:
    override: str
    shape: str
    build: Callable  # (dtype, device, use_nki, seed) -> {name: tensor} of outputs and grads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="cpu or trn2 (trn2 runs the NKI kernels on `neuron`)")
    parser.add_argument("--dtypes", default="float32,bfloat16")


def _seeded(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)


def _fill(module, gen) -> None:
    import torch

    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _rope_case(b, s, h, d):
    def run(dtype, device, use_nki, seed, replaced: bool):
        import torch
        from torchtitan.models.common.rope import CosSinRoPE

        from pipeline.models.nki.modules import NkiRoPE

        cls = NkiRoPE if replaced else CosSinRoPE
        cfg = cls.Config(dim=d, max_seq_len=2 * s, theta=1e6, **({"use_nki": use_nki} if replaced else {}))
        mod = cls(cfg).to(device)
        gen = _seeded(seed)
        q, k = (torch.randn(b, s, n, d, generator=gen) for n in (h, max(h // 2, 1)))
        gq, gk = torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)
        q, k = (t.to(device, dtype).requires_grad_(True) for t in (q, k))
        oq, ok = mod(q, k)
        torch.autograd.backward([oq, ok], [gq.to(device, dtype), gk.to(device, dtype)])
        return {"q": oq, "k": ok, "dq": q.grad, "dk": k.grad}

    return Case("nki_rope", f"B{b} S{s} H{h} D{d}", run)


def _router_case(t, d, e, k):
    def run(dtype, device, use_nki, seed, replaced: bool):
        import torch
        from torchtitan.models.common import Linear
        from torchtitan.models.common.moe import TokenChoiceTopKRouter

        from pipeline.models.nki.modules import NkiRouter

        cls = NkiRouter if replaced else TokenChoiceTopKRouter
        cfg = cls.Config(num_experts=e, gate=Linear.Config(in_features=d, out_features=e), top_k=k,
                         score_func="softmax", route_norm=True, **({"use_nki": use_nki} if replaced else {}))
        mod = cls(cfg)
        gen = _seeded(seed)
        _fill(mod, gen)
        mod = mod.to(device, dtype)
        x = torch.randn(1, t, d, generator=gen).to(device, dtype).requires_grad_(True)
        scores, ids, full = mod(x)
        order = ids.sort(dim=-1)
        picked = scores.gather(-1, order.indices)
        (picked * torch.arange(1, k + 1, device=device)).sum().backward()
        return {"topk_scores": picked, "ids": order.values.to(dtype), "scores": full, "dx": x.grad,
                "dgate": mod.gate.weight.grad}

    return Case("nki_router", f"T{t} D{d} E{e} K{k}", run)


def _experts_case(r, d, f, e):
    def run(dtype, device, use_nki, seed, replaced: bool):
        import torch
        from torchtitan.models.common.moe import GroupedExperts

        from pipeline.models.cpu_overrides import LoopExperts
        from pipeline.models.nki.modules import NkiExperts

        # GroupedExperts' own forward is torch._grouped_mm in bf16 (CUDA kernels); on CPU the
        # module the override displaces is loop_experts, the same SwiGLU in the input dtype.
        cls = NkiExperts if replaced else LoopExperts
        cfg = cls.Config(dim=d, hidden_dim=f, num_experts=e, **({"use_nki": use_nki} if replaced else {}))
        mod = cls(cfg)
        gen = _seeded(seed)
        _fill(mod, gen)
        mod = mod.to(device, dtype)
        counts = torch.multinomial(torch.ones(e), r, replacement=True, generator=gen).bincount(minlength=e)
        x = torch.randn(r, d, generator=gen).to(device, dtype).requires_grad_(True)
        out = mod(x, counts.to(device))
        out.backward(torch.randn(out.shape, generator=gen).to(device, dtype))
        assert isinstance(mod, GroupedExperts)
        return {"out": out, "dx": x.grad, "dw1": mod.w1_EFD.grad, "dw2": mod.w2_EDF.grad, "dw3": mod.w3_EFD.grad}

    return Case("nki_experts", f"R{r} D{d} F{f} E{e}", run)


CASES = [
    _rope_case(2, 128, 4, 128), _rope_case(1, 256, 8, 64),
    _router_case(256, 128, 8, 2), _router_case(128, 256, 64, 8),
    _experts_case(64, 64, 32, 4), _experts_case(200, 128, 64, 8),
]


# Below float32 the top-k *selection* among near-equal scores is not defined (bf16 rounding of x
# reorders near-ties), so those runs compare the full routing scores only.
EXACT_ONLY = {"ids", "topk_scores", "dx", "dgate"}


def _errors(got: dict, ref: dict, dtype_name: str = "float32") -> tuple[float, float]:
    worst_abs = worst_rel = 0.0
    for name, value in ref.items():
        if dtype_name != "float32" and name in EXACT_ONLY:
            continue
        diff = (got[name].float().cpu() - value.float().cpu()).abs().max().item()
        scale = max(value.float().abs().max().item(), 1e-12)
        worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, diff / scale)
    return worst_abs, worst_rel


def verify(dtypes: list[str], device: str = "cpu", use_nki: bool = False, seed: int = 1234) -> list[dict]:
    import torch

    rows = []
    for case in CASES:
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            got = case.build(dtype, device, use_nki, seed, replaced=True)
            same = case.build(dtype, "cpu", False, seed, replaced=False)
            fp32 = case.build(torch.float32, "cpu", False, seed, replaced=False)
            for versus, ref in (("replaced module", same), ("float32 module", fp32)):
                err_abs, err_rel = _errors(got, ref, dtype_name)
                limit = THRESHOLDS[dtype_name] if versus == "replaced module" or dtype_name == "float32" else 4 * THRESHOLDS[dtype_name]
                rows.append({"override": case.override, "shape": case.shape, "dtype": dtype_name, "vs": versus,
                             "max_abs": err_abs, "max_rel": err_rel, "threshold": limit, "pass": err_rel <= limit,
                             "kernel": "nki" if use_nki else "reference"})
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'override':<12} {'shape':<20} {'dtype':<9} {'kernel':<9} {'vs':<16} {'max abs':>10} {'max rel':>10} {'thresh':>8}  ok"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['override']:<12} {r['shape']:<20} {r['dtype']:<9} {r['kernel']:<9} {r['vs']:<16} "
                     f"{r['max_abs']:>10.2e} {r['max_rel']:>10.2e} {r['threshold']:>8.0e}  {'PASS' if r['pass'] else 'FAIL'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[dict]:
    from pipeline.models.nki import kernels

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in THRESHOLDS]
    if unknown:
        raise PipelineError(f"--dtypes {unknown} not supported.", f"use some of {sorted(THRESHOLDS)}.")
    rows = verify(dtypes)
    reason = kernels.nki_unavailable_reason()
    if reason is None:
        device = "neuron" if args.target == "trn2" else "cpu"
        rows += verify(dtypes, device=device, use_nki=True)
    print(table(rows))
    if reason is not None:
        print(f"NKI kernels NOT run here: {reason}. Checked: every override's operator with its PyTorch reference "
              "dispatch (the path CPU training uses); run on trn2 or with the NKI simulator for the kernels.")
    failed = [r for r in rows if not r["pass"]]
    if failed:
        raise PipelineError(f"{len(failed)} of {len(rows)} kernel checks failed (see FAIL rows).",
                            "fix the operator or its adapter before training with --path nki.")
    return rows
