"""LoRA's targets on each model family, and the adapters on the native and nki paths.

native, nki: torchtitan's LoRA converter (torchtitan.components.lora.LoRAConverter, in 0.3.0 and main): target
Linear configs become LoRALinear (frozen base, trainable lora_a/lora_b, output + alpha/rank · B·A·x), every
other module frozen. hf: PEFT's LoRA layers in transformers' own modules (pipeline.models.hf.lora). The
optimizer then holds state only for the adapters (AdamW makes state only for parameters that get gradients).
The run's last step saves the weights merged (W + alpha/rank · B·A; pipeline.titan.lora), so export and verify
see a plain model. MoE experts are no Linear on either model (fused expert tensors): they get no adapters, on
the hf path too, where PEFT would put its parameter LoRA on the fused tensors (hf_targets).

Importable without torch: the launcher checks targets and the memory estimate counts adapters with it.
"""

from __future__ import annotations

from pipeline.errors import PipelineError
from pipeline.run.settings import closest

# torchtitan Qwen3's attention (fused wqkv, wo) and MLP (w1, w2, w3) projections
DEFAULT_TARGETS = ("wqkv", "wo", "w1", "w2", "w3")
# transformers' Qwen3 modules each of torchtitan's projections is (w1 gate, w3 up, w2 down): lora_targets
# written for the native path mean the same projections on the hf path.
HF_MODULES = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",), "w1": ("gate_proj",),
              "w2": ("down_proj",), "w3": ("up_proj",)}
HF_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def targets(settings, arch=None) -> list[str]:
    return list(settings.lora_targets) or list(DEFAULT_TARGETS)


def hf_targets(settings, arch) -> list[str]:
    """The transformers module names PEFT adapts: lora_targets in HF's names or torchtitan's (mapped), by
    default every attention and MLP projection; anything else is refused in one line. An MoE model's MLP
    projections are left out: its experts are fused tensors, not Linears, which PEFT 0.21 would still adapt
    when asked for gate/up/down_proj (its transformers-v5 MoE mapping onto target_parameters); the native path
    gives them no adapters either, and the merge and adapter export handle Linears only."""
    out: list[str] = []
    for name in settings.lora_targets or HF_DEFAULT_TARGETS:
        if name not in HF_DEFAULT_TARGETS and name not in HF_MODULES:
            raise PipelineError(f"lora_targets: {name!r} is no projection of Qwen3 on the hf path"
                                f"{closest(name, HF_DEFAULT_TARGETS + DEFAULT_TARGETS)}.",
                                f"use transformers' names ({', '.join(HF_DEFAULT_TARGETS)}) or torchtitan's "
                                f"({', '.join(DEFAULT_TARGETS)}), or leave lora_targets out for all of them.")
        out += [m for m in HF_MODULES.get(name, (name,)) if m not in out]
    linear = hf_sizes(arch)
    if not any(m in linear for m in out):
        raise PipelineError(f"lora_targets {', '.join(out)}: this MoE model has no such Linear (its experts are fused "
                            "tensors, which get no adapters).", "add attention projections (q_proj, k_proj, v_proj, "
                            "o_proj, or wqkv, wo) to lora_targets, or leave it out.")
    return [m for m in out if m in linear]


def native_sizes(arch) -> dict[str, int]:
    """in + out features of each adaptable projection of one layer (a rank-r adapter has r times that);
    wqkv is one fused projection; MoE layers' experts are no Linear."""
    h, hd, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    qkv = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * hd
    sizes = {"wqkv": h + qkv, "wo": arch.num_attention_heads * hd + h}
    if not arch.is_moe:
        sizes |= {"w1": h + inter, "w2": inter + h, "w3": h + inter}
    return sizes


def hf_sizes(arch) -> dict[str, int]:
    """native_sizes in transformers' modules: q, k and v are three (each its own A)."""
    h, hd, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    sizes = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h}
    if not arch.is_moe:
        sizes |= {"gate_proj": h + inter, "up_proj": h + inter, "down_proj": inter + h}
    return sizes


def apply(description, settings):
    """The model description (pipeline.titan.model_spec) with its model config converted, when settings.lora_rank > 0."""
    if settings.lora_rank <= 0:
        return description
    from torchtitan.components.lora import LoRAConverter
    from torchtitan.protocols.module import Module

    converter = LoRAConverter.Config(rank=settings.lora_rank, alpha=settings.lora_alpha,
                                     target_modules=targets(settings)).build()
    model = converter.convert(description.model)
    # The converter freezes every other module by swapping its config for a dynamic "Frozen…"
    # subclass; the override registry's exact-type overrides (CPU attention, NKI kernels) would then
    # match nothing. Those configs get their own class back (a subclass adds no fields) and the
    # trainer freezes every non-adapter parameter once the model is built (freeze_base).
    for _fqn, cfg, parent, attr in reversed(list(model.traverse(Module.Config, recurse=True))):
        unfrozen = _unfrozen(cfg)
        if unfrozen is cfg:
            continue
        if parent is None:
            model = unfrozen
        elif isinstance(parent, list):
            parent[attr] = unfrozen
        else:
            setattr(parent, attr, unfrozen)
    return description.with_model(model)


def _unfrozen(cfg):
    """The same config in the class the converter's Frozen… subclass was made from."""
    import dataclasses

    cls = type(cfg)
    base = cls.__mro__[1]
    if not cls.__name__.startswith("Frozen") or base.__name__ != cls.__name__.removeprefix("Frozen"):
        return cfg
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
    return base(**values)
