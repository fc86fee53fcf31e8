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

Split by role as torchtitan's models/qwen3 is: `model` (the wrapper and its replaced forwards),
`parallelize` (the TP plan and FSDP), `state_dict_adapter` (HF keys on disk), and `lora` (PEFT's LoRA
layers of a LoRA run); `describe` here hands the first three to torchtitan.
"""

from __future__ import annotations

from pipeline.models.hf.model import HFQwen3
from pipeline.models.hf.parallelize import parallelize_hf_qwen3
from pipeline.models.hf.state_dict_adapter import HFQwen3StateDictAdapter
from pipeline.titan.model_spec import ModelDescription


def describe(config_json: dict, name: str, seq_len: int,
             lora: tuple[int, float, tuple[str, ...]] | None = None) -> ModelDescription:
    """transformers' rotary embedding keeps no cache (cos/sin come from inv_freq per batch): `seq_len` reaches
    torchtitan as the spec's max_context_length (#4328) and the limit update_from_config checks. `lora`: (rank,
    alpha, HF module names) of a LoRA run, whose model carries PEFT's adapters (models/hf/lora.py)."""
    rank, alpha, targets = lora or (0, 0.0, ())
    return ModelDescription(
        name="hf_qwen3",
        flavor=name,
        model=HFQwen3.Config(config_json=config_json, lora_rank=rank, lora_alpha=alpha, lora_targets=targets),
        max_context_length=seq_len,
        parallelize_fn=parallelize_hf_qwen3,
        state_dict_adapter=HFQwen3StateDictAdapter,
    )
