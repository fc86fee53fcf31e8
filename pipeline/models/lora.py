"""LoRA adapters on the native and nki paths through torchtitan's LoRA converter
(torchtitan.components.lora.LoRAConverter, in 0.3.0 and main): target Linear configs become
LoRALinear (frozen base, trainable lora_a/lora_b, output + alpha/rank · B·A·x), every other module
frozen. The optimizer then holds state only for the adapters (AdamW makes state only for parameters
that get gradients). The run's last step saves the weights merged (W + alpha/rank · B·A), so export
and verify see a plain model.
"""

from __future__ import annotations

# torchtitan Qwen3's attention (fused wqkv, wo) and MLP (w1, w2, w3) projections
DEFAULT_TARGETS = ("wqkv", "wo", "w1", "w2", "w3")
ADAPTER_A, ADAPTER_B = ".lora_a.weight", ".lora_b.weight"
FUSED_PARTS = ("wq", "wk", "wv")


def targets(settings) -> list[str]:
    return list(settings.lora_targets) or list(DEFAULT_TARGETS)


def apply(model_spec, settings):
    """The model spec with its model config converted, when settings.lora_rank > 0."""
    if settings.lora_rank <= 0:
        return model_spec
    from torchtitan.components.lora import LoRAConverter

    from torchtitan.protocols.module import Module

    converter = LoRAConverter.Config(rank=settings.lora_rank, alpha=settings.lora_alpha,
                                     target_modules=targets(settings)).build()
    model = converter.convert(model_spec.model)
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
    model_spec.model = model
    return model_spec


def _unfrozen(cfg):
    """The same config in the class the converter's Frozen… subclass was made from."""
    import dataclasses

    cls = type(cfg)
    base = cls.__mro__[1]
    if not cls.__name__.startswith("Frozen") or base.__name__ != cls.__name__.removeprefix("Frozen"):
        return cfg
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
    return base(**values)


def freeze_base(model_parts) -> int:
    """Only the adapters train: every other parameter stops asking for gradients. Returns the count
    of trainable parameters."""
    trainable = 0
    for part in model_parts:
        for name, param in part.named_parameters():
            adapter = ".lora_a." in name or ".lora_b." in name
            param.requires_grad_(adapter)
            trainable += param.numel() if adapter else 0
    return trainable


def merged(state: list[tuple[str, object]], rank: int, alpha: float, kv_heads: int) -> list[tuple[str, object]]:
    """(key, full tensor) with each adapted weight merged and the adapter keys dropped. Gathers one
    weight and its adapters at a time (DTensors are materialised with full_tensor on every rank)."""
    from torch.distributed.tensor import DTensor

    def full(value):
        return value.full_tensor() if isinstance(value, DTensor) else value

    values = dict(state)
    used, out = set(), []
    for key, value in state:
        if key.endswith((ADAPTER_A, ADAPTER_B)):
            continue
        adapted, part = _adapter_of(key, values)
        if adapted is None:
            out.append((key, value))
            continue
        a, b = values[adapted + ADAPTER_A], values[adapted + ADAPTER_B]
        used.add(adapted)
        weight = full(value)
        delta = (alpha / rank) * (full(b).float() @ full(a).float())
        if part is not None:
            delta = _fused_part(delta, part, kv_heads, values, key.rsplit(".", 2)[0])
        out.append((key, (weight.float() + delta).to(weight.dtype)))
    left = {k.removesuffix(ADAPTER_A) for k in values if k.endswith(ADAPTER_A)} - used
    if left:
        raise RuntimeError(f"LoRA adapters with no weight to merge into: {sorted(left)[:3]}")
    return out


def _adapter_of(key: str, values: dict) -> tuple[str | None, str | None]:
    """(the adapted module whose delta this weight takes, which part of a fused wqkv it is or None).
    torchtitan's Qwen3 fuses wq, wk, wv into one wqkv Linear (which the adapters wrap) and splits
    it back into wq, wk, wv in the state dict."""
    base = key.removesuffix(".weight")
    if base + ADAPTER_A in values:
        return base, None
    prefix, _, name = base.rpartition(".")
    fused = f"{prefix}.wqkv"
    if name in FUSED_PARTS and fused + ADAPTER_A in values:
        return fused, name
    return None, None


def _fused_part(delta, part: str, kv_heads: int, values: dict, prefix: str):
    """wq's, wk's or wv's rows of a wqkv-shaped delta. torchtitan's fused layout groups rows per kv
    head: [kv_heads, heads_per_kv + 2, head_dim] (the query heads of the group, then its k, then its
    v; FusedQKVLinear's split on save in torchtitan/models/common/attention.py)."""
    head_dim = values[f"{prefix}.wk.weight"].shape[0] // kv_heads
    per_kv = values[f"{prefix}.wq.weight"].shape[0] // (kv_heads * head_dim)
    grouped = delta.reshape(kv_heads, per_kv + 2, head_dim, delta.shape[-1])
    index = {"wq": slice(0, per_kv), "wk": per_kv, "wv": per_kv + 1}[part]
    return grouped[:, index].reshape(-1, delta.shape[-1])
