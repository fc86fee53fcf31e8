"""training/memory.py: the per-rank HBM estimate printed by dry runs, and the refusal of a plan that
cannot fit a logical NeuronCore's ~24 GiB at LNC=2 (issue 12, "Dry-run matrix and memory")."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conftest import REPO
from pipeline.checkpoint.arch import arch_from_config
from pipeline.errors import PipelineError
from pipeline.models import registry
from pipeline.run import settings as settings_mod
from pipeline.training import memory

GIB = 2**30


def _arch(name):
    return arch_from_config(json.loads((REPO / "configs" / "hub_configs" / f"{name}.json").read_text()))


def _trn2(path="native", **changes):
    return replace(settings_mod.load("trn2", path, registry.names()), **changes)


def test_capacity_is_a_logical_core_share_of_a_chip():
    assert memory.capacity_per_rank("trn2", 2) == 24 * GIB
    assert memory.capacity_per_rank("trn2", 1) == 12 * GIB
    assert memory.capacity_per_rank("cpu", 1) is None


def test_model_state_is_sixteen_bytes_per_parameter_over_the_shards():
    """fp32 master + fp32 gradient + two fp32 AdamW states = 16 B/param, divided by FSDP × TP where
    every part is TP-sharded (native plan) except norms and the router."""
    arch = _arch("Qwen3-4B-Instruct-2507")
    est = memory.estimate(arch, _trn2(), "native", "trn2")
    counts = arch.param_counts()
    replicated = counts["norms"] + counts["final_norm"]
    per_rank = ((arch.num_params - replicated) / 4 + replicated) / 16
    state = est.parts["parameters"] + est.parts["gradients"] + est.parts["optimizer"]
    assert state == pytest.approx(16 * per_rank)


def test_more_sharding_and_more_recompute_need_less():
    arch = _arch("Qwen3-4B-Instruct-2507")
    totals = {ac: memory.estimate(arch, _trn2(activation_checkpoint=ac), "native", "trn2").parts["activations"]
              for ac in ("none", "selective", "full")}
    assert totals["full"] < totals["selective"] < totals["none"]
    tp1 = memory.estimate(arch, _trn2(tensor_parallel=1, sequence_parallel=False), "native", "trn2")
    tp4 = memory.estimate(arch, _trn2(), "native", "trn2")
    assert tp4.total < tp1.total
    longer = memory.estimate(arch, _trn2(seq_len=8192), "native", "trn2")
    assert longer.parts["activations"] > 2 * tp4.parts["activations"]  # linear terms plus the s² scores


def test_a_plan_that_cannot_fit_is_refused_in_one_line():
    arch = _arch("Qwen3-4B-Instruct-2507")
    with pytest.raises(PipelineError) as err:
        memory.check(arch, _trn2(seq_len=32768, activation_checkpoint="none"), "native", "trn2")
    assert "per rank, more than the 21.6 GiB usable of the 24 GiB" in str(err.value) and "\n" not in str(err.value)
    assert memory.check(arch, _trn2(), "native", "trn2").fits


def test_hf_path_keeps_experts_whole_on_each_tp_rank():
    arch = _arch("Qwen3-30B-A3B")
    hf = memory.estimate(arch, _trn2("hf"), "hf", "trn2")
    native = memory.estimate(arch, _trn2(), "native", "trn2")
    assert hf.parts["parameters"] > 3 * native.parts["parameters"]
    with pytest.raises(PipelineError, match="native path"):
        memory.check(arch, _trn2("hf"), "hf", "trn2")
