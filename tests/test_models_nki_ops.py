"""pipeline/models/nki/ops.py: the nki path's custom ops, checked the way torch checks operators:
schema, fake kernel, autograd registration, AOT dispatch (torch.library.opcheck), gradients
(gradcheck in float64) and torch.compile tracing — all on the reference dispatch, which is what
CPU runs."""

import torch

from pipeline.models.nki import ops
from pipeline.models.reference import experts_reference


def rope_inputs(dtype=torch.float32, batch=2, heads=3, seq=8, dim=16):
    torch.manual_seed(0)
    q = torch.randn(batch, heads, seq, dim, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, 1, seq, dim, dtype=dtype, requires_grad=True)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), 1.0 / 1e4 ** (torch.arange(0, dim, 2) / dim))
    angles = torch.cat((angles, angles), dim=-1)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)
    return q, k, cache


def router_inputs(dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(10, 16, dtype=dtype, requires_grad=True), torch.randn(4, 16, dtype=dtype, requires_grad=True)


def experts_inputs(dtype=torch.float32):
    torch.manual_seed(2)
    counts = torch.tensor([3, 0, 4, 2])
    x = torch.randn(int(counts.sum()), 8, dtype=dtype, requires_grad=True)
    w1 = torch.randn(4, 6, 8, dtype=dtype, requires_grad=True)
    w2 = torch.randn(4, 8, 6, dtype=dtype, requires_grad=True)
    w3 = torch.randn(4, 6, 8, dtype=dtype, requires_grad=True)
    return x, counts, w1, w2, w3


def test_opcheck_rope():
    q, k, cache = rope_inputs()
    torch.library.opcheck(ops.rope_hf, (q, k, cache, False, False))


def test_opcheck_router():
    x, w = router_inputs()
    torch.library.opcheck(ops.router_topk, (x, w, 2, False))


def test_opcheck_experts():
    x, counts, w1, w2, w3 = experts_inputs()
    torch.library.opcheck(ops.experts, (x, counts, w1, w2, w3, False),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_gradients_match_finite_differences():
    # rope and router logits compute in float32 by contract (as the kernels do), so their
    # finite differences need float32-sized steps and tolerances; experts keep the input dtype.
    q, k, cache = rope_inputs(torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: ops.rope_hf(a, b, cache, False, False), (q, k),
                                    eps=1e-3, atol=1e-3, rtol=1e-3)
    x, w = router_inputs(torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: ops.router_topk(a, b, 2, False)[0].double(), (x, w),
                                    eps=1e-3, atol=1e-3, rtol=1e-3)
    x, counts, w1, w2, w3 = experts_inputs(torch.float64)
    assert torch.autograd.gradcheck(lambda *t: ops.experts(t[0], counts, *t[1:], False), (x, w1, w2, w3))


def test_rope_backward_is_the_inverse_rotation():
    q, k, cache = rope_inputs()
    fq, fk = ops.rope_hf(q, k, cache, False, False)
    bq, bk = ops.rope_hf(fq, fk, cache, True, False)  # rotation is orthogonal: backward undoes forward
    torch.testing.assert_close(bq, q.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bk, k.detach(), atol=1e-5, rtol=1e-5)


def test_torch_compile_traces_the_ops():
    q, k, cache = rope_inputs()
    x, counts, w1, w2, w3 = experts_inputs()

    def step(q, k, x, w1, w2, w3):
        rq, rk = ops.rope_hf(q, k, cache, False, False)
        return rq.sum() + rk.sum() + ops.experts(x, counts, w1, w2, w3, False).sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, x, w1, w2, w3), step(q, k, x, w1, w2, w3))


def test_experts_op_equals_reference():
    x, counts, w1, w2, w3 = experts_inputs()
    torch.testing.assert_close(ops.experts(x, counts, w1, w2, w3, False), experts_reference(x, counts, w1, w2, w3))

