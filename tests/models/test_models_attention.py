"""models/attention.py and configs/trn2.toml: the trn2 attention needs no Inductor, computes what
FlexAttention computes, and the trn2 settings (eager, FSDP2, document_sdpa) are what runs (issue 12,
finding 8)."""

from __future__ import annotations

import argparse
import tomllib

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO
from titan_batch import fold, unfold
from pipeline.errors import PipelineError
from pipeline.models import attention_backends
from pipeline.run import settings as settings_mod


def _packed_positions(lengths_per_row):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])


def _per_document_reference(q, k, v, positions):
    """Each document alone through plain causal SDPA, stitched back together."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        starts = (positions[b] == 0).nonzero().flatten().tolist() + [q.shape[1]]
        for s, e in zip(starts[:-1], starts[1:]):
            o = F.scaled_dot_product_attention(q[b:b + 1, s:e].transpose(1, 2), k[b:b + 1, s:e].transpose(1, 2),
                                               v[b:b + 1, s:e].transpose(1, 2), is_causal=True, enable_gqa=True)
            out[b:b + 1, s:e] = o.transpose(1, 2)
    return out


def test_document_sdpa_equals_per_document_attention():
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    from pipeline.models.attention import DocumentSDPA

    torch.manual_seed(0)
    positions = _packed_positions([[5, 7, 4], [16]])
    q = torch.randn(2, 16, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, 16, 2, 8, dtype=torch.float64), torch.randn(2, 16, 2, 8, dtype=torch.float64)
    module = DocumentSDPA(DocumentSDPA.Config())
    out = unfold(module(*fold(q, k, v), attention_masks=create_varlen_metadata_for_document(fold(positions)),
                        enable_gqa=True), 2)
    torch.testing.assert_close(out, _per_document_reference(q, k, v, positions), rtol=0, atol=1e-12)


def _root_class():
    from dataclasses import dataclass

    from torchtitan.config.configurable import Configurable

    @dataclass(kw_only=True, slots=True)
    class Root(Configurable.Config):
        model: Configurable.Config

    return Root


def _Root(**kwargs):
    return _root_class()(**kwargs)


def _tiny_loss(attention_backend: str):
    """A tiny native Qwen3 built as the trn2/CPU paths build it (overrides applied by torchtitan's own
    apply_overrides), forward + backward on a packed batch; returns (loss, dynamo frames compiled)."""
    import torch._dynamo.utils as dynamo_utils
    from torchtitan.config.override import OverrideConfig, apply_overrides

    from pipeline.checkpoint.arch import arch_from_config
    from pipeline.checkpoint.embedded import EMBEDDED
    from pipeline.models import native, registry

    arch = arch_from_config(EMBEDDED["tiny"].config)
    settings = settings_mod.TrainSettings(attention_backend=attention_backend)
    imports = list(registry.get("native").overrides("cpu", settings))
    root = _Root(model=native.model_config(arch, attention_backends.titan_backend(attention_backend), max_context_length=32))
    apply_overrides(OverrideConfig(imports=imports), root)
    torch.manual_seed(0)
    model = root.model.build()
    model.init_states()
    dynamo_utils.counters.clear()
    tokens = torch.randint(0, arch.vocab_size, (2, 32))
    positions = _packed_positions([[10, 22], [32]])
    tokens, positions = fold(tokens, positions)
    logits = model(tokens, attention_masks=model.get_attention_masks(positions), positions=positions)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.roll(-1, -1).flatten())
    loss.backward()
    return loss.item(), sum(dynamo_utils.counters["frames"].values()), type(model.layers["0"].attention.inner_attention)


def test_trn2_attention_compiles_nothing_and_matches_flex():
    loss, frames, inner = _tiny_loss("document_sdpa")
    assert inner.__name__ == "DocumentSDPA"  # the override really attached
    assert frames == 0  # no torch.compile (so no Inductor) anywhere in forward or backward
    flex_loss, flex_frames, flex_inner = _tiny_loss("flex")
    assert flex_inner.__name__ == "DenseMaskAttention"
    assert flex_frames > 0  # the counter does see compiles: flex builds its block mask with torch.compile
    assert loss == pytest.approx(flex_loss, abs=1e-5)


def test_backend_choices_agree():
    assert tuple(attention_backends.BACKENDS) == settings_mod.facts("attention_backend")["choices"]


def test_trn2_toml_choices_and_their_reasons():
    text = (REPO / "configs" / "trn2.toml").read_text()
    train = tomllib.loads(text)["train"]
    assert train["compile"] is False and train["attention_backend"] == "document_sdpa"
    for reason in ("qwen3_8b_tp4_fsdp16_sac", "eager", "SimpleFSDP", "Inductor", "fully_shard"):
        assert reason in text


def _dry_run(model, path, tmp_path, monkeypatch, config_text=None):
    from pipeline.stages import train

    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(tmp_path))
    config = None
    if config_text:
        config = tmp_path / "user.toml"
        config.write_text(config_text)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    train.add_arguments(parser)
    argv = ["--model", model, "--path", path, "--target", "trn2", "--dry-run"] + (["--config", str(config)] if config else [])
    return train.run(parser.parse_args(argv))


def test_trn2_dry_run_follows_the_choice(tmp_path, monkeypatch):
    spec = _dry_run("Qwen/Qwen3-4B-Instruct-2507", "native", tmp_path, monkeypatch)
    assert spec.settings.compile is False and spec.settings.attention_backend == "document_sdpa"
    assert attention_backends.DOCUMENT_SDPA in spec.overrides
    assert not any("dense_mask" in str(o) for o in spec.overrides)


def test_trn2_refuses_what_the_neuron_backend_cannot_run(tmp_path, monkeypatch):
    with pytest.raises(PipelineError, match="Inductor"):
        _dry_run("Qwen/Qwen3-4B-Instruct-2507", "native", tmp_path, monkeypatch, '[train]\nattention_backend = "flex"\n')
    with pytest.raises(PipelineError, match="only the neuron backend"):
        _dry_run("Qwen/Qwen3-4B-Instruct-2507", "native", tmp_path, monkeypatch,
                 '[train]\ncompile = true\ncompile_backend = "inductor"\n')
