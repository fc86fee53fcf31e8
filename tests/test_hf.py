"""pipeline.models.hf in one process: the MoE router trains under torchtitan's selective activation
checkpointing (trn2.toml's and cuda.toml's setting), with transformers' own arithmetic, and the TP
plan covers every weight of a block, with sequence parallelism when asked. The plan running on
ranks is tests/test_rehearse.py."""

from __future__ import annotations

import pytest
import torch

from pipeline.checkpoint.embedded import EMBEDDED
from pipeline.models import hf


def _model(name: str) -> hf.HFQwen3:
    torch.manual_seed(0)
    model = hf.HFQwen3(hf.HFQwen3.Config(config_json=EMBEDDED[name].config))
    model.init_states()
    return model


def _batch():
    tokens = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.cat([torch.arange(20), torch.arange(12)]).expand(2, -1)  # two packed documents
    return tokens, positions


def test_moe_trains_under_selective_activation_checkpointing():
    """transformers' router divides topk's output in place; SAC saves topk's outputs and refuses them
    mutated ('Tensor cached during selective activation checkpoint has been mutated')."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    model = _model("tiny-moe")
    tokens, positions = _batch()
    plain = model(tokens, positions)
    plain.float().square().mean().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    SelectiveAC(SelectiveAC.Config()).apply(model.model)
    assert type(model.model.layers[0]).__name__ == "CheckpointWrapper"
    out = model(tokens, positions)
    out.float().square().mean().backward()
    assert torch.equal(out, plain)
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, expected[name.replace("._checkpoint_wrapped_module", "")],
                              rtol=1e-5, atol=1e-7), name


def test_router_is_transformers_arithmetic_out_of_place():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    model = _model("tiny-moe")
    router = model.model.layers[0].mlp.gate
    assert isinstance(router, Qwen3MoeTopKRouter) and type(router) is not Qwen3MoeTopKRouter
    original = Qwen3MoeTopKRouter.__new__(Qwen3MoeTopKRouter)
    original.__dict__ = router.__dict__  # same parameters and settings, transformers' own forward
    x = torch.randn(64, router.hidden_dim)
    for ours, theirs in zip(router(x), original(x), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_tp_plan_covers_every_weight_of_a_block(name, sequence_parallel):
    from torch.distributed.tensor.parallel import SequenceParallel

    model = _model(name)
    layer = model.layers[0]
    is_moe = hasattr(layer.mlp, "experts")
    plan = hf.layer_tp_plan(sequence_parallel, is_moe=is_moe)
    planned = {key for key in plan if not key.endswith(("self_attn", "mlp"))}
    weights = {n.removesuffix(".weight") for n, _ in layer.named_parameters()}
    # Every weight is either split over tp or, by design, replicated: norms under SP are
    # SequenceParallel; without SP they and the MoE block (router, experts) run replicated.
    replicated = {w for w in weights if w not in planned}
    expected_replicated = ({"input_layernorm", "post_attention_layernorm"} if not sequence_parallel else set())
    if is_moe:
        expected_replicated |= {"mlp.gate", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert replicated == {w for w in expected_replicated if w in weights}, replicated
    root = hf.root_tp_plan(sequence_parallel)
    assert set(root) == {"model.embed_tokens", "lm_head"} | ({"model.norm"} if sequence_parallel else set())
    if sequence_parallel:
        assert isinstance(plan["input_layernorm"], SequenceParallel) and "self_attn" in plan and "mlp" in plan


def test_forward_always_passes_a_block_causal_mask(monkeypatch):
    """Under sequence parallelism transformers would size its own causal mask from the embedding's
    local shard, so the model always passes the mask, also without positions."""
    model = _model("tiny")
    seen = {}
    original = model.model.forward

    def spy(*args, **kwargs):
        seen["mask"] = kwargs.get("attention_mask")
        return original(*args, **kwargs)

    monkeypatch.setattr(model.model, "forward", spy)
    tokens, _ = _batch()
    model(tokens)
    assert seen["mask"] is not None and seen["mask"].shape == (2, 1, 32, 32)
    assert torch.equal(seen["mask"][0, 0], torch.ones(32, 32, dtype=torch.bool).tril())
