"""LoRA on the hf path: PEFT's own LoRA layers (peft.tuners.lora.layer.Linear) in transformers' Qwen3, on the
projections pipeline.models.lora.hf_targets names. Only the adapters train (pipeline.titan.lora.freeze_base with
its "peft" names); the run's last step saves the weights merged, as on the native path.

On disk an adapted projection keeps its plain HF key (`…q_proj.weight`); in the model PEFT moved it to
`…q_proj.base_layer.weight`: the state-dict adapter renames between the two (on_disk, in_model).
"""

from __future__ import annotations

from pipeline.titan.lora import NAMES, PEFT_ADAPTER

BASE_LAYER = NAMES["peft"].weight  # ".base_layer.weight"


def inject(causal, rank: int, alpha: float, targets: tuple[str, ...]) -> None:
    """PEFT's LoRA layers in place of the target Linears of `causal` (a transformers causal LM), on whatever
    device its parameters are (meta while torchtitan builds it)."""
    from peft import LoraConfig, inject_adapter_in_model

    # inject_adapter_in_model, not get_peft_model: it swaps the target Linears in place and puts no PeftModel
    # around the model, so every key keeps its HF name (no `base_model.model.` prefix) for the state-dict
    # adapter, the FSDP/TP plans (which address HFQwen3's own children) and DCP; only an adapted weight moves
    # to `<module>.base_layer.weight`, which the state-dict adapter maps to and from its HF key.
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")
    inject_adapter_in_model(config, causal, adapter_name=PEFT_ADAPTER)


def reset(model) -> None:
    """PEFT's own initialisation of every adapter (A Kaiming-uniform, B zero: the model starts as its base),
    for after transformers' _init_weights, which draws every Linear, the adapters' too."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.reset_lora_parameters(PEFT_ADAPTER, True)


def is_adapter(key: str) -> bool:
    return key.endswith((NAMES["peft"].a, NAMES["peft"].b))


def on_disk(key: str) -> str:
    """An adapted weight's HF key (…q_proj.weight for …q_proj.base_layer.weight); other keys unchanged."""
    return key.removesuffix(BASE_LAYER) + ".weight" if key.endswith(BASE_LAYER) else key


def in_model(key: str, targets: tuple[str, ...]) -> str:
    """The model's key of an HF key: a target projection's weight is its base layer's (PEFT matches a target
    by the module name's last part, as here)."""
    module, _, leaf = key.rpartition(".")
    if leaf == "weight" and module.rpartition(".")[2] in targets:
        return module + BASE_LAYER
    return key
