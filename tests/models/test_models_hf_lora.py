"""pipeline/models/hf/lora.py: the hf model of a LoRA run carries PEFT's own LoRA layers on the target projections
(none on MoE experts), only they train, they start as the base (B zero), the state-dict adapter keeps the HF keys
on disk, and the merged weights (what the run's last step saves) give the LoRA model's outputs in a plain
transformers model. A trained run: tests/outputs/test_outputs_export_adapter.py."""

from __future__ import annotations

import pytest
import torch

from pipeline.checkpoint.arch import arch_from_config
from pipeline.checkpoint.embedded import EMBEDDED
from pipeline.models import hf, lora
from pipeline.run.settings import TrainSettings
from pipeline.titan import lora as titan_lora

PEFT = titan_lora.NAMES["peft"]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _description(name: str, settings: TrainSettings):
    return hf.describe(EMBEDDED[name].config, name, 64,
                       lora=(settings.lora_rank, settings.lora_alpha,
                             tuple(lora.hf_targets(settings, arch_from_config(EMBEDDED[name].config)))))


def _model(name: str, settings: TrainSettings) -> hf.HFQwen3:
    torch.manual_seed(0)
    model = hf.HFQwen3(_description(name, settings).model)
    with torch.no_grad():
        model.init_states()
    return model


def _tokens():
    tokens = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(1))
    return tokens, torch.arange(16).unsqueeze(0)


def _train_b(model) -> None:
    """Adapters that change the output (B starts at zero), as training leaves them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(PEFT.b):
                param.normal_(std=0.05)


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_the_lora_model_has_peft_s_lora_layers_and_only_they_train(name):
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    settings = TrainSettings(lora_rank=4, lora_alpha=8.0)
    model = _model(name, settings)
    adapted = {module_name for module_name, module in model.named_modules() if isinstance(module, PeftLoraLinear)}
    moe = arch_from_config(EMBEDDED[name].config).is_moe
    # MoE experts are fused tensors, no Linear: on tiny-moe only attention is adapted
    targets = PROJECTIONS[:4] if moe else PROJECTIONS
    expected = {f"model.layers.{i}.{'self_attn' if p in PROJECTIONS[:4] else 'mlp'}.{p}"
                for i in range(len(model.layers)) for p in targets}
    assert adapted == expected
    assert not isinstance(model.lm_head, PeftLoraLinear)
    trainable = titan_lora.freeze_base([model], PEFT)
    grads = {n for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(n.endswith((PEFT.a, PEFT.b)) for n in grads)
    assert len(grads) == 2 * len(expected)
    assert all(p.abs().max() == 0 for n, p in model.named_parameters() if n.endswith(PEFT.b))  # starts as the base
    assert all(p.abs().max() > 0 for n, p in model.named_parameters() if n.endswith(PEFT.a))
    # the memory estimate counts exactly these adapters
    from pipeline.training import memory

    assert memory.lora_params(arch_from_config(EMBEDDED[name].config), settings, "hf") == trainable


def test_without_lora_the_model_has_no_adapters():
    from peft.tuners.lora.layer import LoraLayer

    model = hf.HFQwen3(hf.HFQwen3.Config(config_json=EMBEDDED["tiny"].config))
    assert not any(isinstance(m, LoraLayer) for m in model.modules())
    assert "model.layers.0.self_attn.q_proj.weight" in dict(model.named_parameters())


def test_state_dict_adapter_keeps_hf_keys_and_the_merge_reproduces_the_lora_model_in_transformers():
    from transformers import AutoModelForCausalLM

    from pipeline.models.hf.model import hf_config

    settings = TrainSettings(lora_rank=4, lora_alpha=8.0, lora_targets=["wqkv", "o_proj", "w2"])
    description = _description("tiny", settings)
    model = _model("tiny", settings)
    _train_b(model)
    tokens, positions = _tokens()
    with torch.no_grad():
        adapted = model(tokens, positions)
    adapter = description.adapter()
    state = list(model.state_dict().items())
    on_disk = adapter.to_hf(dict(state))
    plain = AutoModelForCausalLM.from_config(hf_config(EMBEDDED["tiny"].config), dtype=torch.float32)
    plain_keys = set(plain.state_dict()) - {"lm_head.weight"}  # tied: on disk without it
    assert set(on_disk) == plain_keys  # the source's keys: no base_layer, no adapters
    assert set(adapter.from_hf(on_disk)) == {k for k, _ in state if not k.endswith((PEFT.a, PEFT.b))}
    merged = adapter.to_hf(dict(titan_lora.merged(state, 4, 8.0, 2, PEFT)))
    assert set(merged) == plain_keys
    assert not merged["model.layers.0.self_attn.q_proj.weight"].equal(on_disk["model.layers.0.self_attn.q_proj.weight"])
    assert merged["model.layers.0.mlp.up_proj.weight"].equal(on_disk["model.layers.0.mlp.up_proj.weight"])  # no adapter
    plain.load_state_dict(merged, strict=False)
    plain.tie_weights()
    with torch.no_grad():
        base_logits = plain.eval()(tokens).logits
    assert (adapted - base_logits).abs().max() < 1e-5, (adapted - base_logits).abs().max()
    # and the adapters change the model: the merge is no identity
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.lora_B[titan_lora.PEFT_ADAPTER].weight.zero_()
        assert (model(tokens, positions) - adapted).abs().max() > 1e-4
