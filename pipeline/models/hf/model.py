"""The hf path's model: transformers' causal LM built from the checkpoint's config.json, wrapped as a
torchtitan BaseModel, with the MoE router's and experts' forwards replaced where torchtitan's activation
checkpointing or the TP plan needs them to differ."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from torchtitan.protocols.model import BaseModel

from pipeline.models.hf import lora
from pipeline.models.hf.parallelize import apply_fsdp, parallelize_hf_qwen3
from pipeline.models.hf.state_dict_adapter import HFQwen3StateDictAdapter
from pipeline.titan import api


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
    # Set by torchtitan's trainer for a ChunkedLossWrapper loss (titan.labelled_loss): forward returns the
    # final hidden states and the loss applies lm_head, as torchtitan's Decoder does.
    _skip_lm_head: bool = False

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        config_json: dict = field(default_factory=dict)
        """The checkpoint's config.json, verbatim: the only source of shapes."""
        lora_rank: int = 0
        """> 0: PEFT's LoRA adapters of this rank on `lora_targets` (transformers' module names; models/hf/lora.py)."""
        lora_alpha: float = 0.0
        lora_targets: tuple[str, ...] = ()

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
        if config.lora_rank > 0:
            lora.inject(causal, config.lora_rank, config.lora_alpha, config.lora_targets)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    # torchtitan after #4810 has no ModelSpec: the model class owns its adapter and parallelization
    # (BaseModel.parallelize, its abstract _apply_fsdp).
    state_dict_adapter_cls = HFQwen3StateDictAdapter

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
        if self.config.lora_rank > 0:
            lora.reset(self)
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
        out = hidden.last_hidden_state
        return api.drop_batch_dim(out if self._skip_lm_head else self.lm_head(out), added)
