"""pipeline/titan/dpo.py's Reference with LoRA: the base with its adapters off (their B zero for the reference
forward), found by the adapters' names of the path's model — PEFT's on the hf path (lora_B.<adapter>.weight).
The whole DPO step against TRL: tests/e2e/test_e2e_dpo.py."""

from __future__ import annotations

import torch

from pipeline.checkpoint.arch import arch_from_config
from pipeline.checkpoint.embedded import EMBEDDED
from pipeline.models import hf, lora
from pipeline.run.settings import TrainSettings
from pipeline.titan import lora as titan_lora
from pipeline.titan.dpo import Reference


def test_lora_reference_on_the_hf_model_is_the_base_with_peft_s_adapters_off():
    settings = TrainSettings(lora_rank=4, lora_alpha=8.0)
    config = EMBEDDED["tiny"].config
    targets = tuple(lora.hf_targets(settings, arch_from_config(config)))
    torch.manual_seed(0)
    model = hf.HFQwen3(hf.describe(config, "tiny", 64, lora=(4, 8.0, targets)).model)
    with torch.no_grad():
        model.init_states()
    tokens = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        base = model(tokens, positions)  # B starts at zero: the base model
        names = titan_lora.NAMES["peft"]
        for name, param in model.named_parameters():
            if name.endswith(names.b):
                param.normal_(std=0.05)  # as training leaves them
        policy = model(tokens, positions)
    assert (policy - base).abs().max() > 1e-4
    reference = Reference([model], names)
    assert len(reference.params) == 7 * len(model.layers)  # every adapter's B, nothing else
    reference.take()
    with torch.no_grad():
        with reference.active():
            off = model(tokens, positions)
        again = model(tokens, positions)
    assert torch.equal(off, base)
    assert torch.equal(again, policy)  # the policy's adapters are back
