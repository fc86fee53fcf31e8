"""pipeline.models.registry: the hf path refuses torch.compile with tensor parallelism (its compiled
TP plan computes wrong gradients, found by `make rehearse`), in one line, before anything launches;
every path names where its model shows the parallel plan; on one rank training in fp32 the native
model gets no FSDP (it would shard nothing and cast nothing, only copy every parameter and gradient
each step), with more ranks or parameters in a lower precision it does."""

from __future__ import annotations

import functools

import pytest

from helpers import run_pipeline
from pipeline.models import registry
from pipeline.training.resolve import RunRequest, resolve

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


@pytest.mark.parametrize(("ranks", "config", "fsdp"), [(1, None, False), (2, None, True), (1, "bf16", True)])
def test_fsdp_only_where_it_shards_or_casts(tmp_path, ranks, config, fsdp):
    from torchtitan.models.qwen3 import parallelize_qwen3

    user = None
    if config:
        user = tmp_path / "bf16.toml"
        user.write_text('[train]\ndtype = "bfloat16"\n')
    spec = resolve(RunRequest(model="tiny", path="native", target="cpu", config=user,
                              dry_run=True, checkpoints_root=tmp_path, flags={"nproc_per_node": ranks}))
    fn = registry.get("native").build(spec).parallelize_fn
    if fsdp:
        assert fn is parallelize_qwen3
    else:
        assert isinstance(fn, functools.partial) and fn.func is parallelize_qwen3 and fn.keywords == {"skip_dp": True}
