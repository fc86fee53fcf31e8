"""The hf path's parallelization: the TP plan for transformers' module names, activation checkpointing
and compile through torchtitan's own helpers, and FSDP2 on the data-parallel submesh."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle


# The TP plan, as torch ParallelStyles: the Megatron layout torchtitan's own Qwen3 uses
# (torchtitan.models.common.decoder_sharding), written for transformers' module names.
# - heads and MLP: q/k/v, gate/up colwise, o/down rowwise; q_norm/k_norm act on the local heads, so
#   their weights are replicated DTensors whose gradients are summed over tp (SequenceParallel on
#   the heads dim does exactly that).
# - embedding rowwise (vocab-sharded table) and lm_head colwise with vocab-sharded logits left as
#   local tensors: torchtitan's loss (spmd_types backend) takes a TP run's logits as the local vocab
#   shard and computes a vocab-parallel cross-entropy. Both tables are Shard(0) on tp, so a tied
#   embedding stays one parameter.
# - sequence parallelism (optional): the residual stream between blocks and the norms hold the
#   local sequence shard (Shard(1)); attention and MLP inputs are all-gathered to the full sequence
#   and their rowwise outputs reduce-scattered back to shards.
# - Qwen3-MoE blocks: experts and router are not split over tp (transformers' experts are one
#   fused tensor per projection, routed with index ops a ParallelStyle cannot shard); each tp rank
#   runs the whole block on the full sequence (all-gathered under SP, then sliced back to its shard).
# - whatever is not split is still a DTensor on the tp mesh (Replicate): FSDP then puts every
#   parameter on the same (dp_shard, tp) mesh, which gradient clipping and the optimizer need
#   (a mix of 1-D and 2-D DTensors fails in torch.stack of the per-parameter norms).
class ReplicateParameters(ParallelStyle):
    """Every parameter of the module becomes a Replicate DTensor on the tp mesh; the module computes
    on their local tensors (see model._local), with inputs and outputs untouched."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        return distribute_module(module, device_mesh)  # the default partition replicates every parameter


def root_tp_plan(sequence_parallel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    from torchtitan.distributed.tensor_parallel import NoParallel

    stream = Shard(1) if sequence_parallel else Replicate()
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "model.norm": SequenceParallel() if sequence_parallel else NoParallel(use_local_output=True),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=True),
    }


def layer_tp_plan(sequence_parallel: bool, is_moe: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )
    from torchtitan.distributed.tensor_parallel import NoParallel

    stream = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        "self_attn.o_proj": RowwiseParallel(output_layouts=stream),
    }
    norm = SequenceParallel() if sequence_parallel else NoParallel(use_local_output=True)
    plan |= {"input_layernorm": norm, "post_attention_layernorm": norm}
    if sequence_parallel:
        plan |= {
            # the decoder layer passes hidden_states to self_attn by keyword
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                            use_local_output=True),
        }
    if is_moe:
        plan |= {"mlp.gate": ReplicateParameters(), "mlp.experts": ReplicateParameters()}
        if sequence_parallel:
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
        return plan
    plan |= {
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=stream),
    }
    if sequence_parallel:
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                         use_local_output=True)
    return plan


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """`model` is the hf path's HFQwen3 (models/hf/model.py, which imports this module)."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, root_tp_plan(sequence_parallel))
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, layer_tp_plan(sequence_parallel, is_moe=hasattr(layer.mlp, "experts")))
    if model.tied:
        # Each style replaced its module's parameter with its own DTensor; tie them again (same
        # placement, Shard(0) on tp) before FSDP groups them.
        model.model.embed_tokens.weight = model.lm_head.weight


def parallelize_hf_qwen3(model: nn.Module, *, parallel_dims, training, parallelism, compile_config, ac_config,
                         dump_folder, **_):
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.get_mesh("tp"), parallelism.enable_sequence_parallel)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model.model)
    if compile_config is not None and compile_config.enable and "model" in compile_config.components:
        from torchtitan.distributed.compile import apply_compile

        apply_compile(model.model, compile_config=compile_config, parallel_dims=parallel_dims)
    if parallel_dims.fsdp_enabled:
        apply_fsdp(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism)
    return model


def apply_fsdp(model: nn.Module, *, parallel_dims, training, parallelism) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.fsdp import disable_fsdp_gradient_division, get_fsdp_reshard_after_forward_policy

    # Plain FSDP2 on the data-parallel submesh: transformers' parameters are not DTensors on
    # torchtitan's full SPMD mesh, which fully_shard's dp_mesh_dims mode requires.
    mesh = parallel_dims.get_mesh(["dp_replicate", "dp_shard"] if parallel_dims.dp_replicate_enabled else "dp_shard")
    common = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                                                            reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce]))
    reshard = get_fsdp_reshard_after_forward_policy(parallelism.fsdp_reshard_after_forward, parallel_dims.pp_enabled)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard, **common)
    # A tied embedding/lm_head is one parameter: FSDP2 needs it in exactly one group.
    ends = [model.model.embed_tokens, model.model.norm, model.lm_head]
    if model.tied:
        fully_shard(ends, reshard_after_forward=False, **common)
    else:
        fully_shard(ends[0], reshard_after_forward=reshard, **common)
        fully_shard(ends[1:], reshard_after_forward=False, **common)
    fully_shard(model, **common)
    # torchtitan divides the loss by the global token count itself.
    disable_fsdp_gradient_division(model)
