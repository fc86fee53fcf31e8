"""The nki path's custom ops (pipeline.models.nki.ops) on CPU: checked the way torch checks operators
(opcheck: schema, fake kernel, autograd registration, AOT dispatch; gradcheck), traceable for
torch.compile and for nki_op (whose fake kernel is the op body itself), and the kernel branch's
plumbing — arguments, dtypes, grid, tiling — run against stand-in kernels. The kernels themselves
run only where `nki` imports."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from pipeline.models.nki import kernels, layout, ops
from pipeline.models.nki.constraints import MOE_BLOCK_SIZE, ROUTER_MAX_TOKENS
from pipeline.models.reference import experts_reference

NKI_MISSING = kernels.nki_unavailable_reason()
needs_nki = pytest.mark.skipif(NKI_MISSING is not None, reason=f"NKI kernels cannot run here: {NKI_MISSING} (the real "
                               "packages come from the Neuron pip repository; they run on trn2 or in the NKI simulator)")


def rope_cache(positions: torch.Tensor, dim: int, dtype=torch.float32) -> torch.Tensor:
    angles = positions.double()[..., None] * (1.0 / 1e4 ** (torch.arange(0, dim, 2) / dim))
    angles = torch.cat((angles, angles), dim=-1)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)


def rope_inputs(dtype=torch.float32, batch=2, heads=3, seq=8, dim=16, per_batch=False):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq, dim, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, 1, seq, dim, generator=gen, dtype=dtype, requires_grad=True)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4][:seq], list(range(seq))]) if per_batch else torch.arange(seq)
    return q, k, rope_cache(positions, dim, dtype)


def router_inputs(dtype=torch.float32, tokens=10):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(tokens, 16, generator=gen, dtype=dtype, requires_grad=True),
            torch.randn(4, 16, generator=gen, dtype=dtype, requires_grad=True))


def experts_inputs(dtype=torch.float32, counts=(3, 0, 4, 2)):
    gen = torch.Generator().manual_seed(2)
    counts = torch.tensor(counts)
    e = len(counts)
    shapes = ((int(counts.sum()), 8), (e, 6, 8), (e, 8, 6), (e, 6, 8))
    x, w1, w2, w3 = (torch.randn(s, generator=gen, dtype=dtype, requires_grad=True) for s in shapes)
    return x, counts, w1, w2, w3


@pytest.mark.parametrize("per_batch", [False, True], ids=["cache [S,2D]", "cache [B,S,2D] at positions"])
def test_opcheck_rope(per_batch):
    q, k, cache = rope_inputs(per_batch=per_batch)
    torch.library.opcheck(ops.rope_hf, (q, k, cache, False, False))


def test_opcheck_router():
    x, w = router_inputs()
    torch.library.opcheck(ops.router_topk, (x, w, 2, False))


def test_opcheck_experts():
    # every opcheck utility, AOT dispatch included: the blockwise layout has static shapes
    torch.library.opcheck(ops.experts, (*experts_inputs(), False))


def test_gradients_match_finite_differences():
    # rope and router logits compute in float32 by contract (as torchtitan does), so their finite
    # differences need float32-sized steps and tolerances; experts keep the input dtype.
    q, k, cache = rope_inputs(torch.float64, per_batch=True)
    assert torch.autograd.gradcheck(lambda a, b: ops.rope_hf(a, b, cache, False, False), (q, k),
                                    eps=1e-3, atol=1e-3, rtol=1e-3)
    x, w = router_inputs(torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: ops.router_topk(a, b, 2, False)[0].double(), (x, w),
                                    eps=1e-3, atol=1e-3, rtol=1e-3)
    # fast mode (a random projection of the Jacobian): every experts evaluation runs whole 256-row blocks
    x, counts, w1, w2, w3 = experts_inputs(torch.float64)
    assert torch.autograd.gradcheck(lambda *t: ops.experts(t[0], counts, *t[1:], False), (x, w1, w2, w3),
                                    fast_mode=True)


def test_rope_backward_is_the_inverse_rotation():
    q, k, cache = rope_inputs(per_batch=True)
    fq, fk = ops.rope_hf(q, k, cache, False, False)
    bq, bk = ops.rope_hf(fq, fk, cache, True, False)  # the rotation is orthogonal: backward undoes forward
    torch.testing.assert_close(bq, q.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bk, k.detach(), atol=1e-5, rtol=1e-5)


def test_torch_compile_traces_the_ops_forward_and_backward():
    q, k, cache = rope_inputs(per_batch=True)
    xr, wr = router_inputs()
    x, counts, w1, w2, w3 = experts_inputs()
    leaves = (q, k, xr, wr, x, w1, w2, w3)

    def loss(q, k, xr, wr, x, w1, w2, w3):
        rq, rk = ops.rope_hf(q, k, cache, False, False)
        logits, ids = ops.router_topk(xr, wr, 2, False)
        return rq.sum() + rk.sum() + logits.gather(1, ids).sum() + ops.experts(x, counts, w1, w2, w3, False).pow(2).sum()

    # fullgraph: no graph break around the ops; AOTAutograd traces their backward registrations too
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got, want = compiled(*leaves), loss(*leaves)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves))


@pytest.mark.parametrize("name", ["rope", "router", "experts"])
@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_op_bodies_trace_without_host_syncs(name, mode):
    # nki_op registers the op body as its own fake kernel and as its decomposition under
    # torch.compile: it must trace with fake (and symbolic) shapes and never read a tensor's value.
    bodies = {
        "rope": (ops._rope, (*rope_inputs(per_batch=True), False, False)),
        "router": (ops._router, (*router_inputs(), 2, False)),
        "experts": (ops._experts, (*experts_inputs(), False)),
    }
    body, args = bodies[name]
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    graph = make_fx(body, tracing_mode=mode)(*args)
    assert "_local_scalar_dense" not in graph.code
    assert not any(free_unbacked_symbols(n.meta["val"]) for n in graph.graph.nodes if "val" in n.meta)


def test_lnc_defaults_to_two_on_trn2(monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert kernels.lnc() == 2
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    assert kernels.lnc() == 1
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "4")
    with pytest.raises(ValueError, match="LNC 1 or 2"):
        kernels.lnc()


def test_kernels_launch_with_a_tuple_grid(monkeypatch):
    grids = []

    class Caller:
        def __getitem__(self, grid):
            tuple(map(int, grid))  # what one torch_neuronx nki_hop.py does with the grid: an int fails
            grids.append(grid)
            return lambda *a, **kw: None

    monkeypatch.setattr(kernels, "_wrapped", lambda name: Caller())
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    kernels.launch("rope_hf")
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    kernels.launch("rope_hf")
    assert grids == [(2,), (1,)]


class StandInKernels:
    """kernels.launch(name) → a stand-in that checks the arguments the real kernel would get and
    computes the kernel's contract with the float32 references."""

    def __init__(self):
        self.calls = []

    def __call__(self, name):
        return getattr(self, name)

    def rope_hf(self, q, k, q_out, k_out, rope_cache, backward):
        assert q.shape == q_out.shape and k.shape == k_out.shape and q.is_contiguous() and k.is_contiguous()
        assert rope_cache.dtype == q.dtype and rope_cache.shape[-1] == 2 * q.shape[-1]
        assert rope_cache.dim() == 2 or rope_cache.shape[0] == q.shape[0]
        self.calls.append(("rope_hf", q.shape[2], backward))
        return ops.rope_reference(q, k, rope_cache, backward)

    def router_topk_kernel(self, x, w, k, shard_on_tokens):
        assert x.shape[0] <= ROUTER_MAX_TOKENS and x.dtype == w.dtype and w.shape[0] == x.shape[1]
        assert shard_on_tokens == (x.shape[0] % 2 == 0)  # LNC=2 (unset) splits tokens when it can
        self.calls.append(("router_topk", x.shape[0]))
        logits, ids = ops.router_reference(x, w.T, k)
        return logits, ids.to(torch.uint32), torch.softmax(logits, -1).to(x.dtype)  # router_topk's three outputs

    def moe_cte_shard_on_i(self, *, block_size, **inputs):
        assert block_size == MOE_BLOCK_SIZE
        assert inputs["token_position_to_id"].dtype == torch.int32 and inputs["block_to_expert"].dtype == torch.int32
        floats = [v for k, v in inputs.items() if k not in ("token_position_to_id", "block_to_expert")]
        assert len({t.dtype for t in floats}) == 1, "moe_cte takes one floating dtype"
        self.calls.append(("moe_cte", inputs["hidden_states"].shape[0]))
        return layout.moe_cte_reference(**inputs, block_size=block_size)


@pytest.fixture
def stand_in(monkeypatch):
    fake = StandInKernels()
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    monkeypatch.setattr(ops, "_on_neuron", lambda t, use_nki: use_nki)
    monkeypatch.setattr(kernels, "launch", fake)
    return fake


def test_rope_kernel_branch_forward_and_backward(stand_in):
    q, k, cache = rope_inputs(per_batch=True)
    got = ops.rope_hf(q, k, cache, False, True)
    torch.testing.assert_close(got, ops.rope_reference(q, k, cache, False))
    sum(t.sum() for t in got).backward()
    assert stand_in.calls == [("rope_hf", 8, False), ("rope_hf", 8, True)]


def test_router_kernel_branch_tiles_beyond_2048_tokens(stand_in):
    x, w = router_inputs(tokens=2 * ROUTER_MAX_TOKENS + 5)
    logits, ids = ops.router_topk(x, w, 2, True)
    want_logits, want_ids = ops.router_reference(x, w, 2)
    assert ids.dtype == torch.int64 and logits.dtype == torch.float32
    torch.testing.assert_close(logits, want_logits)
    assert torch.equal(ids.sort(1).values, want_ids.sort(1).values)
    assert stand_in.calls == [("router_topk", 2048), ("router_topk", 2048), ("router_topk", 5)]


def test_experts_kernel_branch(stand_in):
    x, counts, w1, w2, w3 = experts_inputs(counts=(300, 0, 1, 20))
    got = ops.experts(x, counts, w1, w2, w3, True)
    torch.testing.assert_close(got, experts_reference(x, counts, w1, w2, w3), rtol=1e-5, atol=1e-5)
    got.sum().backward()  # reference recompute, not a kernel
    assert stand_in.calls == [("moe_cte", 322)]
    assert x.grad is not None and w2.grad is not None


def test_op_counts_skip_fake_tracing():
    before = dict(ops.COUNTS)
    q, k, cache = rope_inputs()
    ops.rope_hf(q, k, cache, False, False)
    make_fx(ops._rope, tracing_mode="fake")(q.detach(), k.detach(), cache, False, False)
    assert ops.COUNTS["rope_hf.forward"] == before.get("rope_hf.forward", 0) + 1


@needs_nki
def test_rope_hf_kernel_matches_reference_in_simulator(monkeypatch):
    import nki

    from pipeline.models.nki.neuron_kernels import rope as neuron_kernels

    q, k, cache = rope_inputs(seq=256, dim=128, per_batch=False)
    q, k = q.detach(), k.detach()
    q_out, k_out = nki.simulate(neuron_kernels.rope_hf[2])(q, k, torch.empty_like(q), torch.empty_like(k), rope_cache=cache)
    ref_q, ref_k = ops.rope_reference(q, k, cache, False)
    torch.testing.assert_close(q_out, ref_q, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_out, ref_k, atol=1e-4, rtol=1e-4)


@needs_nki
def test_router_topk_kernel_matches_reference_in_simulator():
    import nki

    from pipeline.models.nki.neuron_kernels import router as neuron_kernels

    x, w = (t.detach() for t in router_inputs(tokens=256))
    x, w = torch.nn.functional.pad(x, (0, 112)), torch.nn.functional.pad(w, (0, 112))  # H a multiple of 128
    logits, index, _affinities = nki.simulate(neuron_kernels.router_topk_kernel[2])(x, w.T.contiguous(), 2, True)
    want_logits, want_ids = ops.router_reference(x, w, 2)
    torch.testing.assert_close(torch.as_tensor(logits), want_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(torch.as_tensor(index).long().sort(1).values, want_ids.sort(1).values)


@needs_nki
def test_moe_cte_matches_reference_in_simulator():
    import nki

    from pipeline.models.nki.neuron_kernels import moe as neuron_kernels

    gen = torch.Generator().manual_seed(5)
    counts = torch.tensor([300, 0, 1, 100, 7, 60, 0, 44])  # 512 rows over 8 experts, two empty
    rows, dim, inter = int(counts.sum()), 512, 2048
    x = torch.randn(rows, dim, generator=gen).bfloat16()
    w1, w3 = (torch.randn(8, inter, dim, generator=gen).mul(dim ** -0.5).bfloat16() for _ in range(2))
    w2 = torch.randn(8, dim, inter, generator=gen).mul(inter ** -0.5).bfloat16()
    inputs = layout.moe_cte_inputs(x, w1, w2, w3, layout.blockwise_layout(counts, rows, MOE_BLOCK_SIZE))
    got = nki.simulate(neuron_kernels.moe_cte_shard_on_i[2])(**inputs, block_size=MOE_BLOCK_SIZE)
    want = layout.moe_cte_reference(**{k: (v.float() if v.is_floating_point() else v) for k, v in inputs.items()},
                                    block_size=MOE_BLOCK_SIZE)
    torch.testing.assert_close(torch.as_tensor(got)[:rows].float(), want[:rows], atol=2e-2, rtol=2e-2)
