"""Documented shape rules of each NKI kernel, checked before anything is built or compiled.

Constraints belong to the kernel that will run: the PyTorch reference accepts any shape, so a
kernel whose `backend` is "reference" has no rules. Sources: nki-library docs/docstrings
(rope_hf, router_topk, moe_cte), see /work/shared/notes/neuron.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    value: str  # name of the checked quantity in `dims`
    text: str  # the rule as a user reads it, with {…} filled from dims
    ok: Callable[[dict], bool]


KERNEL_RULES: dict[str, list[Rule]] = {
    "rope_hf": [
        Rule("seq_len", "a multiple of 128 × LNC = {rope_multiple}", lambda d: d["seq_len"] % d["rope_multiple"] == 0),
        Rule("head_dim", "64 or 128", lambda d: d["head_dim"] in (64, 128)),
    ],
    "router_topk": [
        Rule("top_k", "≤ 8", lambda d: d["top_k"] <= 8),
        Rule("num_experts", "≤ 512", lambda d: d["num_experts"] <= 512),
        Rule("hidden", "a multiple of 128", lambda d: d["hidden"] % 128 == 0),
    ],
    "moe_cte": [
        Rule("hidden", "in 512..8192 and a multiple of 512", lambda d: 512 <= d["hidden"] <= 8192 and d["hidden"] % 512 == 0),
        Rule("intermediate_per_tp_rank", "in 2048..16384 and a multiple of 16",
             lambda d: 2048 <= d["intermediate_per_tp_rank"] <= 16384 and d["intermediate_per_tp_rank"] % 16 == 0),
        Rule("experts_per_rank", "in 8..64", lambda d: 8 <= d["experts_per_rank"] <= 64),
        Rule("tokens_per_rank", "≤ 32768", lambda d: d["tokens_per_rank"] <= 32768),
        Rule("top_k", "≤ 8", lambda d: d["top_k"] <= 8),
    ],
}


def dims_for(arch: dict, seq_len: int, local_batch_size: int, lnc: int, tensor_parallel: int) -> dict:
    """The quantities the rules talk about, from a resolved run."""
    return {
        "seq_len": seq_len,
        "rope_multiple": 128 * lnc,
        "head_dim": arch["head_dim"],
        "hidden": arch["hidden_size"],
        "num_experts": arch.get("num_experts", 0),
        "experts_per_rank": arch.get("num_experts", 0),  # no expert parallelism: every rank holds all
        "top_k": arch.get("num_experts_per_tok", 0),
        "intermediate_per_tp_rank": arch.get("moe_intermediate_size", 0) // max(tensor_parallel, 1),
        "tokens_per_rank": seq_len * local_batch_size,
    }


def violations(kernel: str, dims: dict) -> list[str]:
    """One sentence per broken rule, naming kernel, value and rule."""
    out = []
    for rule in KERNEL_RULES[kernel]:
        if not rule.ok(dims):
            out.append(f"{kernel}: {rule.value}={dims[rule.value]} must be {rule.text.format(**dims)}")
    return out
