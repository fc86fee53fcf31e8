"""verify-kernels (pipeline.stages.verify_kernels) itself: its shapes are ones the kernels accept on
trn2 (RoPE at the default LNC=2), every row compares with an independent implementation and passes
on CPU, and a deliberately wrong replacement makes its rows FAIL and the command exit non-zero."""

import pytest

from pipeline.__main__ import main
from pipeline.models.nki import constraints, kernels, ops
from pipeline.models.nki import kernel_check as verify_kernels

REFERENCES = {"nki_rope": "torchtitan CosSinRoPE", "nki_router": "torchtitan TokenChoiceTopKRouter",
              "nki_experts": "transformers Qwen3MoeExperts"}


def test_cases_use_shapes_the_kernels_accept_at_trn2s_default_lnc(monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    assert kernels.lnc() == 2  # trn2's runtime default when the variable is unset
    for lnc in (kernels.lnc(), 1):
        all_cases = verify_kernels.cases(lnc)
        assert {c.override for c in all_cases} == set(REFERENCES)
        for case in all_cases:
            assert constraints.violations(case.kernel, case.dims) == [], case.shape
            assert case.reference_name == REFERENCES[case.override]
    rope = [c.dims["seq_len"] for c in verify_kernels.cases(2) if c.override == "nki_rope"]
    assert rope and all(s % 256 == 0 for s in rope)  # rope_hf: a multiple of 128 × LNC
    assert max(c.dims["tokens"] for c in verify_kernels.cases(2) if c.override == "nki_router") > \
        constraints.ROUTER_MAX_TOKENS  # the op's tiling beyond router_topk's 2048 tokens is checked


def test_every_row_passes_against_its_independent_implementation(capsys):
    assert main(["verify-kernels", "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("nki_")]
    assert len(rows) == len(verify_kernels.cases(2))
    for row in rows:
        override = row.split()[0]
        assert f"{REFERENCES[override]} (float32)" in row and row.endswith("PASS")
    if kernels.nki_unavailable_reason() is not None:  # says so, rather than passing silently
        assert f"NKI kernels NOT run here: {kernels.nki_unavailable_reason()}" in out
        assert all(" reference " in row for row in rows)  # the runs column


def _rope_turning_backwards(original):
    return lambda q, k, cache, backward: original(q, k, cache, not backward)


def _router_with_scaled_logits(original):
    def wrong(x, w, top_k):
        logits, ids = original(x, w, top_k)
        return logits * 1.001, ids
    return wrong


def _experts_with_gate_and_up_swapped(original):
    return lambda x, w1, w2, w3, layout: original(x, w3, w2, w1, layout)


@pytest.mark.parametrize("override,target,wrong", [
    ("nki_rope", "rope_reference", _rope_turning_backwards),
    ("nki_router", "router_reference", _router_with_scaled_logits),
    ("nki_experts", "moe_cte_inputs", _experts_with_gate_and_up_swapped),
])
def test_a_wrong_replacement_fails_its_rows_and_the_command(override, target, wrong, monkeypatch, capsys):
    monkeypatch.setattr(ops, target, wrong(getattr(ops, target)))
    assert main(["verify-kernels", "--dtypes", "float32", "--overrides", override]) == 2
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.startswith("nki_")]
    assert rows and all(row.startswith(override) and row.endswith("FAIL") for row in rows)
    assert captured.err.startswith(f"error: {len(rows)} of {len(rows)} kernel checks failed")


def test_unknown_override_is_refused_in_one_line(capsys):
    assert main(["verify-kernels", "--overrides", "nki_rope,nki_attention"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nki_attention" in err and "Fix:" in err
