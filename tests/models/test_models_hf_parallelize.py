"""pipeline.models.hf (its model and parallelize) in one process: the MoE router trains under torchtitan's selective activation
checkpointing (trn2.toml's and cuda.toml's setting), with transformers' own arithmetic, and the TP
plan covers every weight of a block, with sequence parallelism when asked. The plan running on
ranks is tests/stages/test_stages_rehearse.py."""

from __future__ import annotations

import pytest
import torch

from pipeline.checkpoint.embedded import EMBEDDED
from pipeline.models import hf
from pipeline.models.hf import parallelize


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


def test_experts_are_transformers_loop_without_tp():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    model = _model("tiny-moe")
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, Qwen3MoeExperts) and type(experts) is not Qwen3MoeExperts
    original = Qwen3MoeExperts.__new__(Qwen3MoeExperts)
    original.__dict__ = experts.__dict__
    x = torch.randn(16, experts.hidden_dim)
    index = torch.randint(0, experts.num_experts, (16, 2), generator=torch.Generator().manual_seed(2))
    weights = torch.rand(16, 2)
    assert torch.equal(experts(x, index, weights), original(x, index, weights))


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_tp_plan_puts_every_parameter_on_the_tp_mesh(name, sequence_parallel):
    """Every parameter is under some ParallelStyle: split, or replicated as a DTensor on tp, so that
    with FSDP all of them live on one (dp_shard, tp) mesh (clipping and the optimizer need that)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    model = _model(name)
    plans = [("", parallelize.root_tp_plan(sequence_parallel))]
    plans += [(f"model.layers.{i}.", parallelize.layer_tp_plan(sequence_parallel, is_moe=name == "tiny-moe"))
              for i in range(len(model.layers))]
    covered = {prefix + key for prefix, plan in plans for key, style in plan.items()
               if not type(style).__name__.startswith("PrepareModule")}
    uncovered = [n for n, _ in model.named_parameters() if not any(n.startswith(c + ".") for c in covered)]
    assert not uncovered, uncovered
    layer_plan = dict(plans[1][1])
    assert isinstance(layer_plan["input_layernorm"], SequenceParallel) is sequence_parallel
    assert ("self_attn" in layer_plan) is sequence_parallel  # the gather before attention
    if name == "tiny-moe":
        assert isinstance(layer_plan["mlp.experts"], parallelize.ReplicateParameters)


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
