"""The replacement modules (pipeline.models.nki.modules) against the torchtitan modules they replace,
on CPU in float32: the same numbers, forward and backward, and through torch.compile in one graph.
RoPE gets per-token positions the way torchtitan's HF loader gives them (packed documents, each
restarting at 0), which is how training calls it."""

import pytest
import torch
from torchtitan.models.common import Linear
from torchtitan.models.common.moe import RoutedExperts, TokenChoiceTopKRouter
from torchtitan.models.common.rope import CosSinRoPE
from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

from pipeline.models.cpu_overrides import LoopExperts
from pipeline.models.nki import ops
from pipeline.models.nki.modules import NkiExperts, NkiRoPE, NkiRouter
from pipeline.titan import api
from pipeline.titan.model_spec import rope_config
from titan_batch import fold


def packed_positions(batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """Per-row positions of packed documents: each document restarts at 0."""
    rows = []
    for _ in range(batch):
        cuts = sorted(torch.randperm(seq - 1, generator=gen)[:3].add(1).tolist())
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, seq])]
        rows.append(torch.cat([torch.arange(n) for n in lengths]))
    return torch.stack(rows)


def rope_pair(seq=256, dim=128):
    kw = dict(dim=dim, max_len=2 * seq, theta=1e6)
    return CosSinRoPE(rope_config(CosSinRoPE, **kw)), NkiRoPE(rope_config(NkiRoPE, **kw, use_nki=False))


@pytest.mark.parametrize("with_positions", [True, False], ids=["packed positions", "no positions"])
def test_rope_equals_cossin_rope_exactly(with_positions):
    gen = torch.Generator().manual_seed(0)
    native, nki = rope_pair()
    batch, seq = 2, 256
    positions = fold(packed_positions(batch, seq, gen)) if with_positions else None
    if positions is None and api.folded_batch():
        batch = 1  # main has no batch dim: without positions, the [T] tokens are one sequence
    q = fold(torch.randn(batch, seq, 4, 128, generator=gen))
    k = fold(torch.randn(batch, seq, 2, 128, generator=gen))
    grads = [fold(torch.randn(batch, seq, n, 128, generator=gen)) for n in (4, 2)]
    results = []
    for module in (native, nki):
        qq, kk = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        out = module(qq, kk, positions)
        torch.autograd.backward(out, grads)
        results.append((*out, qq.grad, kk.grad))
    before = ops.COUNTS["rope_hf.forward"]
    nki(q, k, positions)
    assert ops.COUNTS["rope_hf.forward"] == before + 1  # the op ran, positions or not
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)


def router_pair(dim=64, experts=8, top_k=2):
    kw = dict(num_experts=experts, gate=Linear.Config(in_features=dim, out_features=experts), top_k=top_k,
              score_func="softmax", route_norm=True)
    native, nki = TokenChoiceTopKRouter(TokenChoiceTopKRouter.Config(**kw)), NkiRouter(NkiRouter.Config(**kw))
    torch.nn.init.normal_(native.gate.weight)
    nki.load_state_dict(native.state_dict())
    return native, nki


def test_router_equals_token_choice_router_exactly():
    gen = torch.Generator().manual_seed(1)
    native, nki = router_pair()
    x = torch.randn(2, 96, 64, generator=gen)
    results = []
    for module in (native, nki):
        xx = x.clone().requires_grad_(True)
        scores, ids, full = module(xx)
        (scores * torch.arange(1, 3)).sum().add(full.pow(2).sum()).backward()
        results.append((scores, ids, full, xx.grad, module.gate.weight.grad))
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)


def routed(inner, experts, top_k):
    return RoutedExperts(RoutedExperts.Config(
        inner_experts=inner, token_dispatcher=LocalTokenDispatcher.Config(num_experts=experts, top_k=top_k)))


def test_experts_inside_routed_experts_equal_the_per_expert_loop():
    gen = torch.Generator().manual_seed(2)
    dim, hidden, experts, top_k = 32, 16, 6, 2
    loop = routed(LoopExperts.Config(dim=dim, hidden_dim=hidden, num_experts=experts), experts, top_k)
    nki = routed(NkiExperts.Config(dim=dim, hidden_dim=hidden, num_experts=experts), experts, top_k)
    for p in loop.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.3
    nki.load_state_dict(loop.state_dict())
    x = fold(torch.randn(2, 40, dim, generator=gen))
    ids = fold(torch.stack([torch.randperm(experts - 2, generator=gen)[:top_k] for _ in range(80)]).view(2, 40, top_k))  # 2 experts empty
    scores = fold(torch.rand(2, 40, top_k, generator=gen))
    counts = torch.bincount(ids.view(-1), minlength=experts)
    assert (counts == 0).sum() == 2
    results = []
    for module in (loop, nki):
        xx = x.clone().requires_grad_(True)
        out = module(xx, scores, ids, counts)
        out.pow(2).sum().backward()
        results.append((out, xx.grad, *(p.grad for p in module.parameters())))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * want.abs().max().item())


def test_modules_compile_in_one_graph():
    gen = torch.Generator().manual_seed(3)
    _, rope = rope_pair()
    _, router = router_pair()
    experts = NkiExperts(NkiExperts.Config(dim=64, hidden_dim=32, num_experts=8))
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    positions = packed_positions(2, 256, gen)
    q, k = torch.randn(2, 256, 4, 128, generator=gen), torch.randn(2, 256, 2, 128, generator=gen)
    x = torch.randn(2, 48, 64, generator=gen)

    def step(q, k, x):
        rq, rk = rope(q, k, positions)
        scores, ids, _ = router(x)
        # as torchtitan's MoE counts (a static [E]; bincount's length would depend on the data)
        counts = torch.zeros(2, 48, 8, dtype=torch.bool).scatter_(-1, ids, True).sum(dim=(0, 1))
        order = ids.view(-1).argsort(stable=True)
        rows = x.view(-1, 64)[order // 2]
        return rq.sum() + rk.sum() + scores.sum() + experts(rows, counts).pow(2).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, x), step(q, k, x))
