"""Documented shape rules of each NKI kernel, checked before anything is built or compiled.

Constraints belong to the kernel that will run: the PyTorch reference accepts any shape, so a
kernel whose backend is "reference" has no rules. Sources (the kernels' own files in
https://github.com/aws-neuron/nki-library, see docs/sources.md):
- rope_hf (core/embeddings/rope_hf.py, `_validate_apply_rope_inputs`): seq len a multiple of
  128 × LNC; no head_dim restriction (the 64/128 rule belongs to the other `rope` kernel).
- router_topk (core/router_topk/router_topk.py docstring): K ≤ 8, E ≤ 512, H a multiple of 128.
  Its T ≤ 2048 range is not a rule here: ops.router_topk tiles longer inputs into ≤ 2048 chunks.
- moe_cte shard_on_I (core/moe/moe_cte/bwmm_shard_on_I.py docstring, "Intended Usage" and
  "Notes"): block 256..1024 (multiple of 256), up to 32K tokens per call, H 512..8192 (multiple
  of 512), I_TP 2048..16384 (divisible by 16), E 8..64. Our call passes the T×K routed rows as
  moe_cte's tokens (one expert per row), so its token count is seq × batch × top_k.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.run.targets import TRN2

# Every rank holds every expert (no expert parallelism), so a block holds rows of one expert;
# 256 is moe_cte's smallest block (bwmm_shard_on_I: "Block size B must be multiple of 256").
MOE_BLOCK_SIZE = 256
# router_topk docstring: "Intended for token counts T <= 2048"; longer inputs are tiled.
ROUTER_MAX_TOKENS = 2048
# When NEURON_LOGICAL_NC_CONFIG is unset, trn2's runtime runs LNC=2
# (neuron:general/arch/neuron-features/logical-neuroncore-config.html): kernels are launched with that grid and shapes are checked against it.
TRN2_DEFAULT_LNC = TRN2.default_lnc


@dataclass(frozen=True)
class Rule:
    value: str  # name of the checked quantity in `dims`
    text: str  # the rule as a user reads it, with {…} filled from dims
    ok: Callable[[dict], bool]


KERNEL_RULES: dict[str, list[Rule]] = {
    "rope_hf": [
        Rule("seq_len", "a multiple of 128 × LNC = {rope_multiple}", lambda d: d["seq_len"] % d["rope_multiple"] == 0),
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
        Rule("routed_rows_per_rank", "≤ 32768 (seq × batch × top_k rows per call)",
             lambda d: d["routed_rows_per_rank"] <= 32768),
    ],
}


def dims_for(arch: dict, seq_len: int, local_batch_size: int, lnc: int, tensor_parallel: int) -> dict:
    """The quantities the rules talk about, from a resolved run."""
    top_k = arch.get("num_experts_per_tok", 0)
    return {
        "seq_len": seq_len,
        "rope_multiple": 128 * lnc,
        "head_dim": arch["head_dim"],
        "hidden": arch["hidden_size"],
        "num_experts": arch.get("num_experts", 0),
        "experts_per_rank": arch.get("num_experts", 0),  # no expert parallelism: every rank holds all
        "top_k": top_k,
        # TP shards each expert's hidden (F) dimension (torchtitan: w1/w3 Shard(1), w2 Shard(2)).
        "intermediate_per_tp_rank": arch.get("moe_intermediate_size", 0) // max(tensor_parallel, 1),
        # without EP every TP rank routes all of its data-parallel batch's tokens
        "routed_rows_per_rank": seq_len * local_batch_size * top_k,
    }


def violations(kernel: str, dims: dict) -> list[str]:
    """One sentence per broken rule, naming kernel, value and rule."""
    out = []
    for rule in KERNEL_RULES[kernel]:
        if not rule.ok(dims):
            out.append(f"{kernel}: {rule.value}={dims[rule.value]} must be {rule.text.format(**dims)}")
    return out
