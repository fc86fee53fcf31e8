"""LoRA adapters on the native and nki paths through torchtitan's LoRA converter
(torchtitan.components.lora.LoRAConverter, in 0.3.0 and main): target Linear configs become
LoRALinear (frozen base, trainable lora_a/lora_b, output + alpha/rank · B·A·x), every other module
frozen. The optimizer then holds state only for the adapters (AdamW makes state only for parameters
that get gradients). The run's last step saves the weights merged (W + alpha/rank · B·A; pipeline.titan.lora), so
export and verify see a plain model.
"""

from __future__ import annotations

# torchtitan Qwen3's attention (fused wqkv, wo) and MLP (w1, w2, w3) projections
DEFAULT_TARGETS = ("wqkv", "wo", "w1", "w2", "w3")


def targets(settings) -> list[str]:
    return list(settings.lora_targets) or list(DEFAULT_TARGETS)


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
