"""pipeline/models/nki/overrides.py: train-nki for real on CPU; the NKI overrides with reference
dispatch give native's step-1 loss."""

from conftest import read_metrics, run_dir, run_pipeline


def test_nki_step1_loss_equals_native(checkpoints):
    for path in ("native", "nki"):
        run_pipeline("train", "--model", "tiny-moe", "--path", path, "--steps", "2", "--fresh", root=checkpoints)
    native = read_metrics(run_dir(checkpoints, "tiny-moe", "native"))
    nki = read_metrics(run_dir(checkpoints, "tiny-moe", "nki"))
    assert abs(native[0]["loss"] - nki[0]["loss"]) < 1e-5
    assert abs(native[0]["grad_norm"] - nki[0]["grad_norm"]) < 1e-4
    spec = (run_dir(checkpoints, "tiny-moe", "nki") / "run.json").read_text()
    assert "pipeline.models.nki.overrides.nki_rope" in spec and "loop_experts" not in spec
