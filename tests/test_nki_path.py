"""train-nki for real on CPU: the NKI overrides with reference dispatch give native's step-1 loss."""

from conftest import read_metrics, run_pipeline


def test_nki_step1_loss_equals_native(checkpoints):
    for path in ("native", "nki"):
        run_pipeline("train", "--model", "tiny-moe", "--path", path, "--steps", "2", "--fresh", root=checkpoints)
    native = read_metrics(checkpoints / "tiny-moe" / "native")
    nki = read_metrics(checkpoints / "tiny-moe" / "nki")
    assert abs(native[0]["loss"] - nki[0]["loss"]) < 1e-5
    assert abs(native[0]["grad_norm"] - nki[0]["grad_norm"]) < 1e-4
    spec = (checkpoints / "tiny-moe" / "nki" / "run.json").read_text()
    assert "pipeline.nki.overrides.nki_rope" in spec and "loop_experts" not in spec


def test_trn2_dry_run_checks_kernel_constraints(tmp_path):
    bad = run_pipeline("train", "--model", "Qwen3-MoE-trn2-fit", "--path", "nki", "--target", "trn2", "--seq-len", "100",
                       "--dry-run", root=tmp_path, check=False)
    assert bad.returncode == 2 and "multiple of 128 × LNC = 256" in bad.stderr
    good = run_pipeline("train", "--model", "Qwen3-MoE-trn2-fit", "--path", "nki", "--target", "trn2", "--dry-run",
                        root=tmp_path)
    assert "--nproc-per-node=64" in good.stdout
