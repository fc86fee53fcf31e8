"""pipeline.models.registry: the hf path refuses torch.compile with tensor parallelism (its compiled
TP plan computes wrong gradients, found by `make rehearse`), in one line, before anything launches;
every path names where its model shows the parallel plan."""

from __future__ import annotations

from conftest import run_pipeline
from pipeline.models import registry

MODEL = "Qwen/Qwen3-4B-Instruct-2507"  # dry-run resolvable from configs/hub_configs


def test_hf_refuses_compile_with_tensor_parallelism(tmp_path):
    config = tmp_path / "compile.toml"
    config.write_text("[train]\ncompile = true\n")
    result = run_pipeline("train", "--model", MODEL, "--path", "hf", "--target", "trn2", "--dry-run",
                          "--config", str(config), root=tmp_path, check=False)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "wrong gradients under torch.compile" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    # trn2.toml itself runs the hf path eager, so its dry run passes; native may compile.
    assert run_pipeline("train", "--model", MODEL, "--path", "hf", "--target", "trn2", "--dry-run",
                        root=tmp_path).returncode == 0
    assert run_pipeline("train", "--model", MODEL, "--path", "native", "--target", "trn2", "--dry-run",
                        "--config", str(config), root=tmp_path).returncode == 0


def test_every_path_has_plan_landmarks():
    for name in registry.names():
        landmarks = registry.get(name).landmarks
        assert landmarks.colwise.endswith(".weight") and landmarks.rowwise.endswith(".weight")
        assert landmarks.norm.startswith(landmarks.block + ".")
