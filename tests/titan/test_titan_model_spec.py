"""titan/model_spec.py: every path's model reaches torchtitan through one seam, built from what the installed
torchtitan declares (issue 27, item 1): ModelSpec from its fields (#4328's required max_context_length
included), Trainer.Config's model field (`model` after #4810), and RoPE caches sized at the run's seq_len on
every path and API (torchtitan after #4328 no longer resizes them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from pipeline.checkpoint.arch import arch_from_config
from pipeline.checkpoint.embedded import EMBEDDED
from pipeline.errors import PipelineError
from pipeline.models import hf, native
from pipeline.titan import model_spec

SEQ = 96


def _native(**changes):
    return native.describe(arch_from_config(EMBEDDED["tiny-moe"].config), "tiny-moe", SEQ, **changes)


def _installed_spec_fields():
    from torchtitan.protocols.model_spec import ModelSpec

    return {f.name: (f.type, f.default) for f in dataclasses.fields(ModelSpec)}


@dataclass
class SpecAfter4328:
    """ModelSpec as #4328 describes it: the 2026-08-21 fields and a required max_context_length."""

    name: str
    flavor: str
    model: object
    parallelize_fn: Callable
    pipelining_fn: Callable | None
    post_optimizer_build_fn: Callable | None
    state_dict_adapter: type | None
    max_context_length: int


def test_the_installed_model_spec_gets_every_field_it_declares():
    spec = model_spec.model_spec(_native())
    from torchtitan.protocols.model_spec import ModelSpec

    assert type(spec) is ModelSpec and spec.name == "qwen3" and spec.flavor == "tiny-moe"
    assert spec.post_optimizer_build_fn is not None and spec.state_dict_adapter.__name__ == "Qwen3StateDictAdapter"
    if "max_context_length" in _installed_spec_fields():  # the simulated "main after #4328" tier
        assert spec.max_context_length == SEQ


@pytest.mark.parametrize("path", ["hf", "native", "nki"])
def test_a_required_max_context_length_is_the_runs_seq_len_on_every_path(path):
    description = (hf.describe(EMBEDDED["tiny"].config, "tiny", SEQ) if path == "hf" else
                   native.describe(arch_from_config(EMBEDDED["tiny"].config), "tiny", SEQ))
    spec = model_spec.model_spec(description, SpecAfter4328)
    assert spec.max_context_length == SEQ and spec.model is description.model


def test_a_required_field_the_pipeline_cannot_supply_is_named():
    @dataclass
    class SpecWithMore(SpecAfter4328):
        tokenizer_fn: Callable

    with pytest.raises(PipelineError, match=r"ModelSpec requires tokenizer_fn, which the pipeline does not describe"):
        model_spec.model_spec(_native(), SpecWithMore)


def test_a_hook_with_nowhere_to_go_is_refused_and_an_unset_one_dropped():
    @dataclass
    class SpecWithoutHooks:
        name: str
        flavor: str
        model: object
        parallelize_fn: Callable
        pipelining_fn: Callable | None
        state_dict_adapter: type | None

    with pytest.raises(PipelineError, match="has no field for post_optimizer_build_fn"):
        model_spec.model_spec(_native(), SpecWithoutHooks)  # MoE: the load-balancing hook would be lost
    dense = native.describe(arch_from_config(EMBEDDED["tiny"].config), "tiny", SEQ)
    assert model_spec.model_spec(dense, SpecWithoutHooks).name == "qwen3"


def test_trainer_config_gets_the_field_it_declares():
    from pipeline.titan.trainer import PipelineTrainer

    assert model_spec.model_field(PipelineTrainer.Config) == "model_spec"  # 0.3.0, main, main after #4328
    assert set(model_spec.trainer_fields(_native(), PipelineTrainer.Config)) == {"model_spec"}

    @dataclass
    class TrainerAfter4810:  # #4810/#4829: Trainer.Config.model holds the model config
        model: object = None

    described = hf.describe(EMBEDDED["tiny"].config, "tiny", SEQ)
    assert model_spec.trainer_fields(described, TrainerAfter4810) == {"model": described.model}
    assert model_spec.fqn_root(TrainerAfter4810) == "model" and model_spec.fqn_root(PipelineTrainer.Config) == "model_spec.model"
    # the class must own the adapter the path needs: this torchtitan's Qwen3Model does not (after #4810 it does)
    with pytest.raises(PipelineError, match="takes the state-dict adapter from the model class: .*Qwen3Model"):
        model_spec.trainer_fields(_native(), TrainerAfter4810)


def test_hf_model_class_owns_what_torchtitan_after_4810_asks_of_it():
    """After #4810 the model class carries the adapter (`state_dict_adapter_cls`) and parallelizes itself
    (`parallelize`, with `_apply_fsdp` abstract on BaseModel): the hf path's class has both, the same code as its
    ModelSpec's parallelize_fn."""
    assert hf.HFQwen3.state_dict_adapter_cls is hf.HFQwen3StateDictAdapter
    assert callable(hf.HFQwen3.parallelize) and callable(hf.HFQwen3._apply_fsdp)


def test_rope_config_uses_the_length_field_the_installed_rope_declares():
    from torchtitan.models.common.rope import CosSinRoPE

    config = model_spec.rope_config(CosSinRoPE, dim=16, max_len=SEQ, theta=1e6)
    field = model_spec.rope_length_field(CosSinRoPE.Config)
    assert field in ("max_seq_len", "max_context_length") and getattr(config, field) == SEQ

    @dataclass
    class NoLength:
        dim: int

    with pytest.raises(PipelineError, match="declares neither max_context_length nor max_seq_len"):
        model_spec.rope_length_field(NoLength)


def _rope_lengths(model_config) -> list[int]:
    field = model_spec.rope_length_field(type(model_config.layers[0].attention.rope))
    return [getattr(layer.attention.rope, field) for layer in model_config.layers]


@pytest.mark.parametrize("path", ["native", "nki"])
def test_rope_caches_are_built_at_seq_len_and_stay_there_through_the_trainer(path, tmp_path):
    """The trainer's own config (entry.build_config), then its update_from_config: every layer's RoPE is seq_len
    long. Before, it was built at max_position_embeddings and only 0.3.0/main's update_from_config shrank it."""
    from pipeline.training import entry
    from pipeline.training.resolve import RunRequest, resolve

    spec = resolve(RunRequest(model="tiny", path=path, target="cpu", dry_run=True, checkpoints_root=tmp_path,
                              flags={"seq_len": 64}))
    assert spec.settings.seq_len == 64 and spec.arch.max_position_embeddings > 64
    config = entry.build_config(spec)
    model_config = getattr(config, model_spec.model_field(type(config))).model
    assert _rope_lengths(model_config) == [64] * spec.arch.num_hidden_layers  # as built
    model_config.update_from_config(config=config)
    assert _rope_lengths(model_config) == [64] * spec.arch.num_hidden_layers  # as the trainer leaves it
