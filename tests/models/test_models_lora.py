"""pipeline/models/lora.py: torchtitan's LoRA converter on the native model; the merged weights
(what the run's last step saves and export reads) give the LoRA model's own outputs in a plain
model; the hf path refuses LoRA in one line."""

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
    assert memory.lora_params(spec.arch, settings) == out["trainable"]
    estimate = memory.estimate(spec.arch, settings, "native", "cpu")
    assert estimate.parts["optimizer"] == 8 * out["trainable"] / settings.world_size


def test_the_hf_path_refuses_lora_in_one_line(tmp_path):
    from dataclasses import replace

    from pipeline.training.resolve import RunRequest, check_lora, resolve

    spec = resolve(RunRequest(model="tiny", path="hf", target="cpu", dry_run=True, checkpoints_root=tmp_path))
    spec.settings = replace(spec.settings, lora_rank=8)
    with pytest.raises(PipelineError, match="LoRA .* runs on the native and nki paths"):
        check_lora(spec)
