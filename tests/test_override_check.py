"""Override registry semantics the nki path relies on: match, no-match warning, conflicts, constraints."""

import argparse

import pytest

pytest.importorskip("torchtitan")

from pipeline import override_check, train  # noqa: E402
from pipeline.embedded import EMBEDDED  # noqa: E402
from pipeline.errors import PipelineError  # noqa: E402
from pipeline.native_model import model_config  # noqa: E402
from pipeline.qwen3_arch import arch_from_config  # noqa: E402

TARGET_DIR = "tests._override_fixtures"


@pytest.fixture(scope="module")
def moe_config():
    return model_config(arch_from_config(EMBEDDED["tiny-moe"].config, "tiny-moe"))


def test_match_counts_every_layer(moe_config):
    report = override_check.check(["pipeline.nki.overrides.nki_rope", "pipeline.nki.overrides.nki_router"], moe_config)
    assert report.count("nki_rope") == 2 and report.count("nki_router") == 2
    assert report.warnings == []
    assert "nki_rope → 2× CosSinRoPE" in report.summary()


def test_no_match_warns_with_closest_names():
    dense = model_config(arch_from_config(EMBEDDED["tiny"].config, "tiny"))
    report = override_check.check(["pipeline.nki.overrides.nki_rope", "pipeline.nki.overrides.nki_router"], dense)
    assert report.count("nki_router") == 0
    assert len(report.warnings) == 1 and "nki_router matched nothing" in report.warnings[0]
    assert "model_spec.model.layers." in report.warnings[0]


def test_same_node_conflict_names_both(moe_config):
    with pytest.raises(PipelineError, match="loop_experts.*nki_experts|nki_experts.*loop_experts"):
        override_check.check(["pipeline.cpu_overrides.loop_experts", "pipeline.nki.overrides.nki_experts"], moe_config)


def test_ancestor_conflict(moe_config):
    from tests import override_fixtures  # noqa: F401  registers whole_moe

    with pytest.raises(PipelineError, match="ancestor"):
        override_check.check(["tests.override_fixtures.whole_moe", "pipeline.nki.overrides.nki_router"], moe_config)


def _resolve(**kw):
    args = argparse.Namespace(model="Qwen3-MoE-trn2-fit", path="nki", target="trn2", steps=None, seq_len=None,
                              nproc_per_node=None, config=None, dry_run=True, fresh=False)
    vars(args).update(kw)
    return train.resolve(args)


def test_seq_len_100_at_lnc2_names_256():
    with pytest.raises(PipelineError, match=r"seq_len=100 must be a multiple of 128 × LNC = 256"):
        _resolve(seq_len=100)


def test_trn2_fit_model_takes_every_kernel():
    spec = _resolve()
    assert all(o["runs"] == o["kernel"] for o in spec.nki["overrides"].values())
    assert spec.nki["matched"]["pipeline.nki.overrides.nki_experts"] == 24


def test_qwen3_30b_a3b_outside_moe_cte_ranges():
    with pytest.raises(PipelineError, match="intermediate_per_tp_rank=192"):
        _resolve(model="Qwen3-30B-A3B")


def test_cpu_nki_replaces_loop_experts():
    spec = _resolve(model="tiny-moe", target="cpu")
    names = [o if isinstance(o, str) else o[0] for o in spec.overrides]
    assert "pipeline.cpu_overrides.loop_experts" not in names
    assert "pipeline.nki.overrides.nki_experts" in names
    assert all(o["runs"] == "reference" for o in spec.nki["overrides"].values())
