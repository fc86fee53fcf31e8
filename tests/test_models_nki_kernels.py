"""pipeline/models/nki/kernels.py: the NKI kernels against their PyTorch references, where the NKI
packages can run (trn2, or the NKI CPU simulator); skipped with the reason elsewhere."""

import pytest
import torch

from pipeline.models.nki import kernels, ops
from test_models_nki_ops import rope_inputs


@pytest.mark.skipif(kernels.nki_unavailable_reason() is not None,
                    reason=f"NKI kernels cannot run here: {kernels.nki_unavailable_reason()} (the real packages come "
                           "from the Neuron pip repository; they run on trn2 or in the NKI CPU simulator)")
def test_nki_rope_kernel_matches_reference_in_simulator(monkeypatch):
    monkeypatch.setenv("NKI_SIMULATOR", "1")
    q, k, cache = rope_inputs(seq=256, dim=128)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    kernels.rope_hf()[1](q.detach(), k.detach(), q_out, k_out, rope_cache=cache, backward=False)
    ref_q, ref_k = ops.rope_reference(q.detach(), k.detach(), cache, False)
    torch.testing.assert_close(q_out, ref_q, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_out, ref_k, atol=1e-4, rtol=1e-4)
