"""pipeline/models/override_check.py: override registry semantics the nki path relies on: match,
no-match warning, conflicts."""

import pytest

from pipeline.checkpoint.arch import arch_from_config
from pipeline.checkpoint.embedded import EMBEDDED
from pipeline.errors import PipelineError
from pipeline.models import override_check
from pipeline.models.native import model_config
from pipeline.titan import model_spec

NKI = "pipeline.models.nki.overrides"


@pytest.fixture(scope="module")
def moe_config():
    return model_config(arch_from_config(EMBEDDED["tiny-moe"].config, "tiny-moe"), max_context_length=128)


def test_match_counts_every_layer(moe_config):
    report = override_check.check([f"{NKI}.nki_rope", f"{NKI}.nki_router"], moe_config)
    assert report.count("nki_rope") == 2 and report.count("nki_router") == 2
    assert report.warnings == []
    assert "nki_rope → 2× CosSinRoPE" in report.summary()


def test_no_match_warns_with_closest_names():
    dense = model_config(arch_from_config(EMBEDDED["tiny"].config, "tiny"), max_context_length=128)
    report = override_check.check([f"{NKI}.nki_rope", f"{NKI}.nki_router"], dense)
    assert report.count("nki_router") == 0
    assert len(report.warnings) == 1 and "nki_router matched nothing" in report.warnings[0]
    assert f"{model_spec.fqn_root()}.layers." in report.warnings[0]


def test_same_node_conflict_names_both(moe_config):
    with pytest.raises(PipelineError, match="loop_experts.*nki_experts|nki_experts.*loop_experts"):
        override_check.check(["pipeline.models.cpu_overrides.loop_experts", f"{NKI}.nki_experts"], moe_config)


def test_ancestor_conflict(moe_config):
    with pytest.raises(PipelineError, match="ancestor"):  # the module is imported by name, as torchtitan does
        override_check.check(["tests.override_fixtures.whole_moe", f"{NKI}.nki_router"], moe_config)

