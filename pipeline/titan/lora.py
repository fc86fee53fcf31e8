"""LoRA inside torchtitan's trainer (pipeline.models.lora and pipeline.models.hf.lora make the adapters): only
the adapters train, and a run's last step saves the weights merged, W + alpha/rank · B·A, in the plain model's
state-dict layout, so export and verify see an ordinary checkpoint.

Two layouts of adapter names, one per way of making them (TrainingPath.lora.names picks one): torchtitan's
LoRALinear (`<module>.weight` beside `<module>.lora_a.weight`) and PEFT's LoRA layer (`<module>.base_layer.weight`
beside `<module>.lora_A.<adapter name>.weight`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdapterNames:
    """Where a model keeps an adapted module's weight and its adapters, as suffixes of the module's name."""

    a: str
    b: str
    weight: str


# PEFT's default adapter name, which pipeline.models.hf.lora injects under (and export_adapter writes under).
PEFT_ADAPTER = "default"
NAMES = {
    "titan": AdapterNames(".lora_a.weight", ".lora_b.weight", ".weight"),
    "peft": AdapterNames(f".lora_A.{PEFT_ADAPTER}.weight", f".lora_B.{PEFT_ADAPTER}.weight", ".base_layer.weight"),
}
ADAPTER_A, ADAPTER_B = NAMES["titan"].a, NAMES["titan"].b
FUSED_PARTS = ("wq", "wk", "wv")


def freeze_base(model_parts, names: AdapterNames = NAMES["titan"]) -> int:
    """Only the adapters train: every other parameter stops asking for gradients. Returns the count
    of trainable parameters."""
    trainable = 0
    for part in model_parts:
        for name, param in part.named_parameters():
            adapter = name.endswith((names.a, names.b))
            param.requires_grad_(adapter)
            trainable += param.numel() if adapter else 0
    return trainable


def adapter_tensors(state: list[tuple[str, object]], names: AdapterNames = NAMES["titan"]) -> list[tuple[str, object]]:
    """(key, full CPU tensor) of every adapter; every rank calls it (DTensors gather collectively)."""
    from torch.distributed.tensor import DTensor

    return [(key, (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().contiguous())
            for key, value in state if key.endswith((names.a, names.b))]


def peft_tensors(adapters: dict, weights: dict, to_hf_key, kv_heads: int,
                 names: AdapterNames = NAMES["titan"]) -> dict:
    """The adapters in PEFT's layout: `base_model.model.<HF module>.lora_A/lora_B.weight`. `weights`:
    the run's weight keys → tensors or meta tensors (shapes only), `to_hf_key` maps one of them to its
    HF key. A fused wqkv adapter becomes q/k/v adapters sharing A, each with its rows of B: B·A's rows
    are B's rows times A, so each part's delta is exactly its rows of the fused delta (merged())."""
    out = {}
    for key in adapters:
        if not key.endswith(names.a):
            continue
        module = key.removesuffix(names.a)
        a, b = adapters[key], adapters[module + names.b]
        prefix, _, name = module.rpartition(".")
        parts = [(f"{prefix}.{p}", p) for p in FUSED_PARTS] if name == "wqkv" else [(module, None)]
        for base, part in parts:
            rows = b if part is None else _fused_part(b, part, kv_heads, weights, prefix)
            hf = "base_model.model." + to_hf_key(base + names.weight).removesuffix(".weight")
            out[hf + ".lora_A.weight"], out[hf + ".lora_B.weight"] = a.clone(), rows.contiguous()
    return out


def merged(state: list[tuple[str, object]], rank: int, alpha: float, kv_heads: int,
           names: AdapterNames = NAMES["titan"]) -> list[tuple[str, object]]:
    """(key, full tensor) with each adapted weight merged and the adapter keys dropped (the weight keeps its
    key: the path's state-dict adapter names it on disk). Gathers one weight and its adapters at a time
    (DTensors are materialised with full_tensor on every rank)."""
    from torch.distributed.tensor import DTensor

    def full(value):
        return value.full_tensor() if isinstance(value, DTensor) else value

    values = dict(state)
    used, out = set(), []
    for key, value in state:
        if key.endswith((names.a, names.b)):
            continue
        adapted, part = _adapter_of(key, values, names)
        if adapted is None:
            out.append((key, value))
            continue
        a, b = values[adapted + names.a], values[adapted + names.b]
        used.add(adapted)
        weight = full(value)
        delta = (alpha / rank) * (full(b).float() @ full(a).float())
        if part is not None:
            delta = _fused_part(delta, part, kv_heads, values, key.rsplit(".", 2)[0])
        out.append((key, (weight.float() + delta).to(weight.dtype)))
    left = {k.removesuffix(names.a) for k in values if k.endswith(names.a)} - used
    if left:
        raise RuntimeError(f"LoRA adapters with no weight to merge into: {sorted(left)[:3]}")
    return out


def _adapter_of(key: str, values: dict, names: AdapterNames) -> tuple[str | None, str | None]:
    """(the adapted module whose delta this weight takes, which part of a fused wqkv it is or None).
    torchtitan's Qwen3 fuses wq, wk, wv into one wqkv Linear (which the adapters wrap) and splits
    it back into wq, wk, wv in the state dict."""
    if not key.endswith(names.weight):
        return None, None
    base = key.removesuffix(names.weight)
    if base + names.a in values:
        return base, None
    prefix, _, name = base.rpartition(".")
    fused = f"{prefix}.wqkv"
    if name in FUSED_PARTS and fused + names.a in values:
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
