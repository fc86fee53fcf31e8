"""pipeline/models/nki/prepare.py: while a run resolves (dry runs too), the nki path picks its
overrides, checks each kernel's constraints for the target and matches them against the model."""

import pytest

from pipeline.errors import PipelineError
from pipeline.training.resolve import RunRequest, resolve
from helpers import run_pipeline

# Full tier: each test here runs the CLI in a fresh interpreter (seconds apiece).
pytestmark = pytest.mark.slow

NKI = "pipeline.models.nki.overrides"


@pytest.fixture
def resolve_nki(tmp_path):
    def resolve_(**kw):
        request = dict(model="Qwen3-MoE-trn2-fit", path="nki", target="trn2", dry_run=True, checkpoints_root=tmp_path)
        return resolve(RunRequest(**{**request, **kw}))

    return resolve_


def test_seq_len_100_at_lnc2_names_256(resolve_nki):
    with pytest.raises(PipelineError, match=r"seq_len=100 must be a multiple of 128 × LNC = 256"):
        resolve_nki(flags={"seq_len": 100})


def test_trn2_fit_model_takes_every_kernel(resolve_nki):
    spec = resolve_nki()
    assert all(o["runs"] == o["kernel"] for o in spec.nki["overrides"].values())
    assert spec.nki["matched"][f"{NKI}.nki_experts"] == spec.arch.num_hidden_layers  # one per MoE layer


def test_qwen3_30b_a3b_outside_moe_cte_ranges(resolve_nki):
    with pytest.raises(PipelineError, match="intermediate_per_tp_rank=192"):
        resolve_nki(model="Qwen/Qwen3-30B-A3B")


def test_cpu_nki_replaces_loop_experts(resolve_nki):
    spec = resolve_nki(model="tiny-moe", target="cpu")
    names = [o if isinstance(o, str) else o[0] for o in spec.overrides]
    assert "pipeline.models.cpu_overrides.loop_experts" not in names
    assert f"{NKI}.nki_experts" in names
    assert all(o["runs"] == "reference" for o in spec.nki["overrides"].values())


def test_trn2_dry_run_checks_kernel_constraints(tmp_path):
    bad = run_pipeline("train", "--model", "Qwen3-MoE-trn2-fit", "--path", "nki", "--target", "trn2", "--seq-len", "100",
                       "--dry-run", root=tmp_path, check=False)
    assert bad.returncode == 2 and "multiple of 128 × LNC = 256" in bad.stderr
    good = run_pipeline("train", "--model", "Qwen3-MoE-trn2-fit", "--path", "nki", "--target", "trn2", "--dry-run",
                        root=tmp_path)
    assert "--nproc-per-node=64" in good.stdout
