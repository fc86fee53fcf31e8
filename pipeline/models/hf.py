"""Path `hf`: Hugging Face Transformers' own Qwen3 / Qwen3-MoE, trained by torchtitan's Trainer.

The model is `AutoModelForCausalLM.from_config` on the checkpoint's config.json, so its shapes
are the checkpoint's (head_dim, rope_theta, tied embeddings, experts) and its forward is
transformers' code. torchtitan's experimental transformers backend is not used for the model:
in 0.3.0 it unties tied embeddings for FSDP (gradients then differ from the tied checkpoint),
swaps Qwen3-MoE's experts for torchtitan's MoE (bf16 grouped_mm, keys no longer HF's), leaves
RoPE's inv_freq uninitialised on transformers 5.16 (it looks for `rope_init_fn`) and only
routes attention through FlexAttention, which has no CPU backward. What is kept from torchtitan:
the Trainer, the BaseModel/ModelSpec protocol, FSDP2 settings, activation checkpointing policies.

State-dict keys are HF's own in-memory names (`model.layers.0.self_attn.q_proj.weight`,
`lm_head.weight`, and for MoE `model.layers.0.mlp.experts.gate_up_proj`): the wrapper registers
the causal LM's `model` and `lm_head` as its own children. `HFQwen3StateDictAdapter` only splits
and fuses the experts (on disk: one key per expert) and drops a tied lm_head.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from torchtitan.protocols.model import BaseModel
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from pipeline.titan import api
from pipeline.titan.model_spec import ModelDescription

# transformers' attention for the CPU path: SDPA takes the dense block-causal mask built below.
ATTENTION = "sdpa"
# transformers' per-expert loop runs in the parameters' dtype; grouped_mm kernels would not
# (and are not what a float32 comparison with the native path can use).
EXPERTS = "eager"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter the TP plan replicated over tp (a Replicate DTensor) as the plain tensor the
    module computes with; its gradient comes back Replicate, which is right because every tp rank
    runs the module on the same full input."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _router_forward(self, hidden_states: torch.Tensor):
    """transformers' Qwen3MoeTopKRouter.forward with the top-k renormalisation out of place.

    transformers divides topk's output in place (`router_top_value /= …`); torchtitan's selective
    activation checkpointing saves topk's outputs (so a recompute routes tokens the same way) and
    refuses a saved tensor that was mutated, so the hf path's MoE could not train with
    activation_checkpoint = "selective" (trn2.toml, cuda.toml). Same arithmetic otherwise; under
    TP the weight is replicated over tp and used locally.
    """
    import torch.nn.functional as F

    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, _local(self.weight))
    router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        router_top_value = router_top_value / router_top_value.sum(dim=-1, keepdim=True)
    return router_logits, router_top_value.to(router_logits.dtype), router_indices


def _experts_forward(self, *args):
    """transformers' expert loop, on the local tensors of tp-replicated parameters (its index ops
    have no DTensor rules); unchanged without TP."""
    from torch.distributed.tensor import DTensor

    params = dict(self.named_parameters(recurse=False))
    if not any(isinstance(p, DTensor) for p in params.values()):
        return type(self).__mro__[1].forward(self, *args)
    return torch.func.functional_call(self, {name: _local(p) for name, p in params.items()}, args)


# transformers class name → what the hf path runs instead (a subclass with this forward).
_REPLACED_FORWARDS = {"Qwen3MoeTopKRouter": _router_forward, "Qwen3MoeExperts": _experts_forward}
_SUBCLASSES: dict[type, type] = {}


def _with_forward(cls: type) -> type:
    if cls not in _SUBCLASSES:
        forward = _REPLACED_FORWARDS[cls.__name__]
        _SUBCLASSES[cls] = type(f"{cls.__name__}Pipeline", (cls,), {"forward": forward})
    return _SUBCLASSES[cls]


def block_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: causal and same-document; documents start where positions restart at 0."""
    seq = positions.shape[1]
    doc = torch.cumsum((positions == 0).to(torch.int32), dim=1)
    same_doc = doc[:, :, None] == doc[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=positions.device).tril()
    return (same_doc & causal).unsqueeze(1)


def hf_config(config_json: dict):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**config_json)
    cfg._attn_implementation = ATTENTION
    if hasattr(cfg, "num_experts"):
        cfg._experts_implementation = EXPERTS
    return cfg


class HFQwen3(BaseModel):
    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        config_json: dict = field(default_factory=dict)
        """The checkpoint's config.json, verbatim: the only source of shapes."""

        def update_from_config(self, *, config, **kwargs) -> None:
            limit = int(self.config_json.get("max_position_embeddings", 0))
            if limit and api.seq_len_of(config.training) > limit:
                from pipeline.errors import PipelineError

                raise PipelineError(f"seq_len {api.seq_len_of(config.training)} exceeds max_position_embeddings {limit}.",
                                    f"use SEQ_LEN ≤ {limit}.")

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            # One FLOP count per model, whatever path implements it: Qwen3Arch's (torchtitan's convention).
            from pipeline.checkpoint.arch import arch_from_config

            nparams = sum(p.numel() for p in model.parameters())
            return nparams, arch_from_config(self.config_json, "the hf path's config.json").flops_per_token(seq_len)

    def __init__(self, config: Config):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.config = config
        causal = AutoModelForCausalLM.from_config(hf_config(config.config_json), dtype=torch.get_default_dtype())
        # Registering the causal LM's own children (not the causal LM) keeps its keys unprefixed.
        self.model = causal.model
        self.lm_head = causal.lm_head
        self.tied = bool(causal.config.tie_word_embeddings)
        object.__setattr__(self, "_causal", causal)
        for module in self.model.modules():
            if type(module).__name__ in _REPLACED_FORWARDS:
                module.__class__ = _with_forward(type(module))

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    # torchtitan after #4810 has no ModelSpec: the model class owns its adapter (`state_dict_adapter_cls`, set
    # below the adapter's definition) and parallelization (BaseModel.parallelize, its abstract _apply_fsdp).
    def parallelize(self, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder, **_):
        return parallelize_hf_qwen3(self, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                    compile_config=compile_config, ac_config=ac_config, dump_folder=dump_folder)

    def _apply_fsdp(self, *, parallel_dims, training, parallelism) -> None:
        apply_fsdp(self, parallel_dims=parallel_dims, training=training, parallelism=parallelism)

    def verify_module_protocol(self) -> None:
        # transformers' submodules are plain nn.Modules by design; nothing here relies on
        # torchtitan's Module protocol (parallelism is applied in parallelize_hf_qwen3).
        pass

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        if self.tied:
            # to_empty() re-creates parameters one module at a time, which unties them.
            self.model.embed_tokens.weight = self.lm_head.weight
        for module in self._causal.modules():
            if module is not self._causal:
                self._causal._init_weights(module)
        self._init_rope(buffer_device)

    def _init_rope(self, buffer_device: torch.device | None) -> None:
        # inv_freq is computed in the rotary module's __init__, which ran on the meta device:
        # after to_empty() it is uninitialised memory. Recompute it the way transformers does.
        rope = self.model.rotary_emb
        inv_freq, scaling = rope.compute_default_rope_parameters(rope.config, buffer_device or rope.inv_freq.device)
        rope.inv_freq = inv_freq.to(rope.inv_freq.device)
        rope.original_inv_freq = inv_freq.clone().to(rope.inv_freq.device)
        rope.attention_scaling = scaling

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, **unused) -> torch.Tensor:
        (tokens,), added = api.with_batch_dim(2, tokens)  # [T] packed tokens on torchtitan main (titan.api)
        if added and positions is not None:
            positions = positions.unsqueeze(0)
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand(tokens.shape[0], -1)
        # Packed documents: positions restart per document (RoPE) and a block-causal mask keeps
        # attention inside each document, as torchtitan's native path does. The mask is always
        # passed: under sequence parallelism transformers would size its own from the embedding's
        # local sequence shard.
        mask = block_causal_mask(positions)
        hidden = self.model(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=False)
        return api.drop_batch_dim(self.lm_head(hidden.last_hidden_state), added)


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
    on their local tensors (see _local), with inputs and outputs untouched."""

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


def apply_tp(model: "HFQwen3", tp_mesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, root_tp_plan(sequence_parallel))
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, layer_tp_plan(sequence_parallel, is_moe=hasattr(layer.mlp, "experts")))
    if model.tied:
        # Each style replaced its module's parameter with its own DTensor; tie them again (same
        # placement, Shard(0) on tp) before FSDP groups them.
        model.model.embed_tokens.weight = model.lm_head.weight


def parallelize_hf_qwen3(model: HFQwen3, *, parallel_dims, training, parallelism, compile_config, ac_config,
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


def apply_fsdp(model: HFQwen3, *, parallel_dims, training, parallelism) -> None:
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


_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class HFQwen3StateDictAdapter(StateDictAdapter):
    """Model keys are HF's; on disk MoE experts are one key per expert and a tied lm_head is absent."""

    def __init__(self, model_config: HFQwen3.Config, hf_assets_path: str | None):
        super().__init__(model_config, hf_assets_path)
        cfg = model_config.config_json
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        self.placements: dict[str, tuple] = {}

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        out = {}
        for key, value in state_dict.items():
            if self.tied and key == "lm_head.weight":
                continue
            match = _FUSED.match(key)
            if not match:
                out[key] = value
                continue
            if isinstance(value, DTensor):
                self.placements[key] = (value.device_mesh, value.placements)
                value = value.full_tensor()
            prefix, name = match.groups()
            for e in range(value.shape[0]):
                if name == "down_proj":
                    out[f"{prefix}.{e}.down_proj.weight"] = value[e].clone()
                else:
                    gate, up = value[e].chunk(2, dim=0)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()
                    out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.tensor import distribute_tensor

        out, experts = {}, {}
        for key, value in hf_state_dict.items():
            match = _PER_EXPERT.match(key)
            if match:
                prefix, e, name = match.groups()
                experts.setdefault(prefix, {})[(int(e), name)] = value
            else:
                out[key] = value
        for prefix, parts in experts.items():
            n = self.num_experts
            gate_up = torch.stack([torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], 0) for e in range(n)])
            down = torch.stack([parts[(e, "down_proj")] for e in range(n)])
            for name, value in (("gate_up_proj", gate_up), ("down_proj", down)):
                key = f"{prefix}.{name}"
                if key in self.placements:
                    mesh, placements = self.placements[key]
                    value = distribute_tensor(value, mesh, placements)
                out[key] = value
        if self.tied and "model.embed_tokens.weight" in out:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out


HFQwen3.state_dict_adapter_cls = HFQwen3StateDictAdapter


def describe(config_json: dict, name: str, seq_len: int) -> ModelDescription:
    """transformers' rotary embedding keeps no cache (cos/sin come from inv_freq per batch): `seq_len` reaches
    torchtitan as the spec's max_context_length (#4328) and the limit update_from_config checks."""
    return ModelDescription(
        name="hf_qwen3",
        flavor=name,
        model=HFQwen3.Config(config_json=config_json),
        max_context_length=seq_len,
        parallelize_fn=parallelize_hf_qwen3,
        state_dict_adapter=HFQwen3StateDictAdapter,
    )
