"""The hf path's state-dict adapter: the model's keys are HF's own; on disk each MoE expert is its own
key (the model holds them fused), a tied lm_head is absent, and in a LoRA run an adapted projection's weight
is its plain key (the model's PEFT layer holds it as base_layer) and the adapters are not there at all."""

from __future__ import annotations

import re
from typing import Any

import torch

from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from pipeline.models.hf import lora


_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class HFQwen3StateDictAdapter(StateDictAdapter):
    """Model keys are HF's; on disk MoE experts are one key per expert and a tied lm_head is absent."""

    def __init__(self, model_config, hf_assets_path: str | None):  # model_config: HFQwen3.Config
        super().__init__(model_config, hf_assets_path)
        cfg = model_config.config_json
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        self.placements: dict[str, tuple] = {}
        self.lora_targets = tuple(model_config.lora_targets) if model_config.lora_rank > 0 else ()

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        out = {}
        for key, value in state_dict.items():
            # The adapters are no part of the HF checkpoint: a load leaves them as initialised, and the last
            # step's save has merged them (pipeline.titan.lora.merged) before it gets here.
            if (self.tied and key == "lm_head.weight") or lora.is_adapter(key):
                continue
            key = lora.on_disk(key)
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
                out[lora.in_model(key, self.lora_targets) if self.lora_targets else key] = value
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
