"""The routed experts: nki-library's `moe_cte` (core/moe/moe_cte/moe_cte.py) with its spec built inside
our one `@nki.jit`, so wrap_nki passes only tensors and ints."""

from __future__ import annotations

import nki
from nkilib.core.moe.moe_cte.moe_cte import MoECTEImplementation, MoECTESpec, moe_cte

from pipeline.models.nki.neuron_kernels import plain_function

__all__ = ["moe_cte_shard_on_i"]


# A bare `@nki.jit` (NKI 0.7: `nki.jit(fn=None, *, compile_config=None, specialization_config=None,
# **kwargs)`, awsdocs-neuron v2.33.1 nki/api/generated/nki.jit). moe_cte itself is `@nki.jit(mode="trace")`
# in the nki-library snapshot read here (2026-04-13); from NKI 0.7 every kernel is specialized by tracing
# it with Python (announce-nki-specialization-change), so the bare jit traces as well.
@nki.jit
def moe_cte_shard_on_i(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                       token_position_to_id, block_to_expert, block_size: int):
    """moe_cte, shard_on_I: every block on both cores, the intermediate dimension split between them
    (LNC=2); no block-count rounding needed. moe_cte is already jitted, so its plain function is called
    here (plain_function: no second jit around an nki-library kernel).
    Shapes: hidden [T+1, H] (row T the zero padding token), affinities [(T+1)·E, 1], gate_up
    [E, H, 2, I], down [E, I, H], token_position_to_id [N·B] int32, block_to_expert [N, 1] int32.
    """
    return plain_function(moe_cte)(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                                   token_position_to_id, block_to_expert, block_size,
                                   MoECTESpec(implementation=MoECTEImplementation.shard_on_i),
                                   is_tensor_update_accumulating=True)
