"""pipeline/models/lora.py: torchtitan's LoRA converter on the native model; the merged weights
(what the run's last step saves and export reads) give the LoRA model's own outputs in a plain
model; the hf path's targets in transformers' names (torchtitan's mapped, others refused in one line).
PEFT's layers in the hf model: tests/models/test_models_hf_lora.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pipeline.errors import PipelineError
from helpers import REPO

MERGE_CHECK = textwrap.dedent("""
    import json, sys
    from dataclasses import replace
    import torch
    from pipeline.titan import patches
    patches.apply("cpu")
    from torchtitan.components.checkpointer import ModelWrapper
    from pipeline.models import lora, registry
    from pipeline.titan import lora as titan_lora
    from pipeline.training.resolve import RunRequest, resolve

    spec = resolve(RunRequest(model="tiny", path="native", target="cpu", dry_run=True, flags={"nproc_per_node": 1}))
    plain_spec = registry.get("native").build(spec)
    spec.settings = replace(spec.settings, lora_rank=4, lora_alpha=8.0)
    lora_spec = registry.get("native").build(spec)
    torch.manual_seed(0)
    adapted = lora_spec.model.build()
    adapted.init_states()
    with torch.no_grad():  # adapters that change the output (B starts at zero)
        for name, param in adapted.named_parameters():
            if name.endswith("lora_b.weight"):
                param.normal_(std=0.05)
    trainable = titan_lora.freeze_base([adapted])
    plain = plain_spec.model.build()
    plain.init_states()  # buffers (RoPE tables) are not in the state dict
    state = titan_lora.merged(list(ModelWrapper(adapted).state_dict().items()), 4, 8.0, spec.arch.num_key_value_heads)
    ModelWrapper(plain).load_state_dict(dict(state))
    tokens = torch.randint(0, 1000, (1, 16))
    positions = torch.arange(16).unsqueeze(0)
    from pipeline.titan import api
    if api.folded_batch():  # torchtitan main's models take [T] packed tokens
        tokens, positions = tokens[0], positions[0]
    with torch.no_grad():
        outputs = [m(tokens, positions=positions, attention_masks=m.get_attention_masks(positions=positions))
                   for m in (adapted, plain)]
        diff = (outputs[0] - outputs[1]).abs().max().item()
    names = [k for k, _ in state]
    print(json.dumps({"diff": diff, "trainable": trainable, "lora_keys": [k for k in names if "lora" in k],
                      "keys": names, "plain_keys": list(ModelWrapper(plain).state_dict()), "targets": sorted({n.rsplit(".", 2)[-2] for n, p in adapted.named_parameters()
                                                              if p.requires_grad})}))
""")


def test_merged_weights_reproduce_the_lora_model_in_a_plain_one(tmp_path):
    result = subprocess.run([sys.executable, "-c", MERGE_CHECK], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={"PIPELINE_CHECKPOINTS": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["lora_keys"] == [] and out["keys"] == out["plain_keys"]  # a plain model's state dict
    assert out["diff"] < 1e-5, out
    assert out["targets"] == ["lora_a", "lora_b"] and out["trainable"] > 0  # only adapters train
    # the memory estimate counts the adapters the converter really made (gradients, AdamW state)
    from dataclasses import replace

    from pipeline.training import memory
    from pipeline.training.resolve import RunRequest, resolve

    spec = resolve(RunRequest(model="tiny", path="native", target="cpu", dry_run=True, checkpoints_root=tmp_path))
    settings = replace(spec.settings, lora_rank=4, lora_alpha=8.0)
    assert memory.lora_params(spec.arch, settings, "native") == out["trainable"]
    estimate = memory.estimate(spec.arch, settings, "native", "cpu")
    assert estimate.parts["optimizer"] == 8 * out["trainable"] / settings.world_size


def test_hf_targets_are_transformers_names_and_torchtitan_s_are_mapped():
    from pipeline.checkpoint.arch import arch_from_config
    from pipeline.checkpoint.embedded import EMBEDDED
    from pipeline.models import lora
    from pipeline.run.settings import TrainSettings

    dense, moe = (arch_from_config(EMBEDDED[name].config) for name in ("tiny", "tiny-moe"))
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert lora.hf_targets(TrainSettings(lora_rank=8), dense) == every
    assert lora.hf_targets(TrainSettings(lora_rank=8, lora_targets=["wqkv", "w2"]), dense) == ["q_proj", "k_proj",
                                                                                               "v_proj", "down_proj"]
    assert lora.hf_targets(TrainSettings(lora_rank=8, lora_targets=["o_proj", "w1", "gate_proj"]), dense) == [
        "o_proj", "gate_proj"]
    # MoE: the experts are fused tensors, no Linear: the MLP targets are left out (as on native)
    assert lora.hf_targets(TrainSettings(lora_rank=8), moe) == every[:4]
    with pytest.raises(PipelineError, match="this MoE model has no such Linear"):
        lora.hf_targets(TrainSettings(lora_rank=8, lora_targets=["w1", "w3"]), moe)
    # the native path's own names, untouched
    assert lora.targets(TrainSettings(lora_rank=8)) == ["wqkv", "wo", "w1", "w2", "w3"]


def test_an_unknown_target_on_the_hf_path_is_refused_before_launch(tmp_path):
    from dataclasses import replace

    from pipeline.training.resolve import RunRequest, check_lora, resolve

    spec = resolve(RunRequest(model="tiny", path="hf", target="cpu", dry_run=True, checkpoints_root=tmp_path))
    spec.settings = replace(spec.settings, lora_rank=8)
    check_lora(spec)  # the hf path takes LoRA now
    spec.settings = replace(spec.settings, lora_targets=["q_prj"])
    with pytest.raises(PipelineError, match=r"'q_prj' is no projection of Qwen3 on the hf path \(did you mean q_proj\?\)") \
            as refused:
        check_lora(spec)
    assert "\n" not in str(refused.value) and "wqkv" in refused.value.fix


def test_lora_with_tensor_parallelism_on_the_hf_path_is_refused_in_one_line(tmp_path):
    from dataclasses import replace

    from pipeline.models import registry
    from pipeline.training.resolve import RunRequest, resolve

    spec = resolve(RunRequest(model="tiny", path="hf", target="cpu", dry_run=True, checkpoints_root=tmp_path))
    spec.settings = replace(spec.settings, lora_rank=8, tensor_parallel=2, nproc_per_node=2)
    with pytest.raises(PipelineError, match="no tensor-parallel plan for PEFT's adapter layers"):
        registry.get("hf").prepare(spec, True)
    registry.get("hf").prepare(replace(spec, settings=replace(spec.settings, lora_rank=0)), True)  # full TP: as before
