"""pipeline/checkpoint/arch.py: Qwen3's architecture read from real config.json files, in both the
transformers 4 and 5 forms; configs torchtitan's Qwen3 cannot train faithfully are refused."""

import json

import pytest

from pipeline.checkpoint.arch import arch_from_config
from pipeline.errors import PipelineError
from helpers import REPO

HUB = REPO / "configs" / "hub_configs"


def hub(name: str) -> dict:
    return json.loads((HUB / f"{name}.json").read_text())


def test_real_qwen3_configs():
    a = arch_from_config(hub("Qwen3-4B-Instruct-2507"))
    assert (a.hidden_size, a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads) == (2560, 36, 32, 8)
    assert a.head_dim == 128 != a.hidden_size // a.num_attention_heads
    assert a.rope_theta == 5e6 and a.tie_word_embeddings and not a.is_moe
    assert "lm_head.weight" not in a.expected_shapes()
    s = arch_from_config(hub("Qwen3-0.6B"))
    assert (s.hidden_size, s.intermediate_size, s.rope_theta) == (1024, 3072, 1e6)
    assert s.expected_shapes()["model.layers.0.self_attn.q_proj.weight"] == (16 * 128, 1024)
    m = arch_from_config(hub("Qwen3-30B-A3B"))
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size) == (128, 8, 768)
    shapes = m.expected_shapes()
    assert shapes["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert shapes["model.layers.0.mlp.gate.weight"] == (128, 2048) and "lm_head.weight" in shapes


def test_transformers5_form_is_read():
    cfg = hub("Qwen3-0.6B")
    cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 123.0}
    assert arch_from_config(cfg).rope_theta == 123.0


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, "model_type is 'llama'"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"num_key_value_heads": 5}, "not a multiple"),
])
def test_unsupported_configs_are_refused(change, message):
    with pytest.raises(PipelineError, match=message):
        arch_from_config({**hub("Qwen3-0.6B"), **change})

