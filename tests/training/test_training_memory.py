"""training/memory.py: the per-rank HBM estimate printed by dry runs, and the refusal of a plan that
cannot fit a logical NeuronCore's ~24 GiB at LNC=2 (issue 12, "Dry-run matrix and memory")."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from helpers import REPO
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


def test_the_estimate_reads_each_paths_own_tp_plan():
    """One source (issue 17, 3.4): the estimate takes what TP shards from the path's registry entry. The
    hf path's plan shards the embedding and lm_head (vocab-parallel loss) and runs sequence parallelism
    like native's, so a dense model needs the same on both but native's RoPE caches (transformers keeps none)."""
    arch = _arch("Qwen3-4B-Instruct-2507")
    hf = memory.estimate(arch, _trn2("hf"), "hf", "trn2")
    native = memory.estimate(arch, _trn2(), "native", "trn2")
    assert hf.parts == pytest.approx({k: v for k, v in native.parts.items() if k != "rope caches"}) and hf.total < 6 * GIB
    for path in registry.names():
        plan = memory.plan_for(path, _trn2(path))
        assert plan.tp_sharded == registry.get(path).tp_plan.sharded
        assert plan.sequence_parallel and plan.vocab_parallel_loss == registry.get(path).tp_plan.vocab_parallel_loss
    assert not memory.plan_for("hf", _trn2("hf", tensor_parallel=1)).sequence_parallel


def test_rope_caches_are_counted_at_seq_len_per_layer():
    """issue 27: each layer of the native and nki paths keeps a float32 cos|sin cache of seq_len × 2·head_dim, now
    built at seq_len (torchtitan after #4328 no longer shrinks it from max_position_embeddings); hf keeps none."""
    arch = _arch("Qwen3-4B-Instruct-2507")
    for path in ("native", "nki"):
        est = memory.estimate(arch, _trn2(path), path, "trn2")
        assert est.parts["rope caches"] == arch.num_hidden_layers * 4096 * 2 * arch.head_dim * 4  # 144 MiB
        longer = memory.estimate(arch, _trn2(path, seq_len=8192), path, "trn2")
        assert longer.parts["rope caches"] == 2 * est.parts["rope caches"]
    assert "rope caches" not in memory.estimate(arch, _trn2("hf"), "hf", "trn2").parts


def test_native_rope_caches_are_what_the_model_builds():
    """The part counted is the buffers torchtitan's Qwen3 really holds, built from the run's seq_len."""
    import torch

    from pipeline.checkpoint.embedded import EMBEDDED
    from pipeline.models import native

    arch = arch_from_config(EMBEDDED["tiny"].config)
    with torch.device("meta"):
        model = native.model_config(arch, max_context_length=96).build()
    caches = [b for name, b in model.named_buffers() if name.endswith("rope.cache")]
    settings = replace(settings_mod.load("cpu", "native", registry.names()), seq_len=96)
    counted = memory.estimate(arch, settings, "native", "cpu").parts["rope caches"]
    assert len(caches) == arch.num_hidden_layers and sum(b.numel() * b.element_size() for b in caches) == counted


def test_trn2_counts_the_runtime_microcode_reserve():
    """96 MB per physical NeuronCore (Neuron docs, neuron-runtime/explore/device-memory): 192 MB a rank at LNC=2."""
    arch = _arch("Qwen3-0.6B")
    assert memory.estimate(arch, _trn2(), "native", "trn2").parts["runtime reserve"] == 2 * 96 * 2**20
    assert memory.estimate(arch, _trn2(lnc=1), "native", "trn2").parts["runtime reserve"] == 96 * 2**20
    cpu = replace(settings_mod.load("cpu", "native", registry.names()))
    assert "runtime reserve" not in memory.estimate(arch, cpu, "native", "cpu").parts


def _docs_memory_table() -> dict[tuple[str, str], str]:
    text = (REPO / "docs" / "trn2.md").read_text()
    section = text[text.index("**Memory.**"):text.index("**What to expect.**")]
    rows = [line for line in section.splitlines() if line.startswith("| Qwen3")]
    header = next(line for line in section.splitlines() if line.startswith("| model |"))
    paths = [c.strip() for c in header.strip("|").split("|")][1:]
    return {(cells[0], path): cell for line in rows
            for cells in [[c.strip() for c in line.strip("|").split("|")]] for path, cell in zip(paths, cells[1:])}


def test_the_trn2_memory_table_in_the_docs_is_the_estimate():
    """docs/trn2.md's Memory table is what the code estimates for configs/trn2.toml (issue 27: it said 14.9 GiB for
    the 4B on hf where the code said 5.3): every figure, a refused plan's too."""
    table = _docs_memory_table()
    assert {path for _, path in table} == set(registry.names()) and len(table) == 9
    for (model, path), cell in table.items():
        est = memory.estimate(_arch(model), _trn2(path), path, "trn2")
        if cell.startswith("refused"):
            figure = re.search(r"~([\d.]+) GiB", cell)
            assert not est.fits if figure else path == "nki", (model, path, cell)  # nki: the kernel's range
            assert figure is None or figure.group(1) == f"{est.total / GIB:.1f}", (model, path, cell, est.total / GIB)
        else:
            assert cell == f"{est.total / GIB:.1f} GiB", (model, path, cell, f"{est.total / GIB:.1f} GiB")


def test_hf_registry_plan_is_the_plan_hf_py_applies():
    """The hf entry's TensorParallelPlan against models/hf/parallelize.py's ParallelStyles: a part is sharded exactly
    when its modules get a Colwise/Rowwise style (the rest are replicated on every tp rank)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from pipeline.models.hf import parallelize

    declared = registry.get("hf").tp_plan
    styles = {**parallelize.root_tp_plan(True), **parallelize.layer_tp_plan(True, is_moe=False)}
    moe_styles = parallelize.layer_tp_plan(True, is_moe=True)
    modules = {"attention": [styles[f"self_attn.{p}_proj"] for p in "qkvo"],
               "mlp": [styles[f"mlp.{p}_proj"] for p in ("gate", "up", "down")],
               "experts": [moe_styles["mlp.experts"]], "router": [moe_styles["mlp.gate"]],
               "embedding": [styles["model.embed_tokens"]], "lm_head": [styles["lm_head"]]}
    for part, part_styles in modules.items():
        sharded = all(isinstance(s, (ColwiseParallel, RowwiseParallel)) for s in part_styles)
        assert sharded == (part in declared.sharded), part
    assert declared.sequence_parallel and "model.norm" in styles and "self_attn" in styles  # SP's gathers
    assert declared.vocab_parallel_loss and styles["lm_head"].output_layouts == (Shard(-1),)  # vocab-sharded logits


class LiveBytes:
    """Bytes of the storages that tensors made inside the `with` hold, and their peak: every op's outputs
    counted once per storage while any tensor made on it lives (views included)."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        tracker._track(t)
                return out

        self.mode, self.holders, self.sizes, self.now, self.peak = Mode(), {}, {}, 0, 0

    def _track(self, t):
        import weakref

        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0:
            return
        if key not in self.holders:
            self.holders[key], self.sizes[key] = 0, storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.holders[key] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key):
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.now -= self.sizes.pop(key)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def test_nki_experts_backward_memory_is_what_the_estimate_counts():
    """The nki experts op's backward on CPU (issue 17, 3.3): beyond what exists when it starts, its peak
    stays within memory.experts_backward_bytes — weight-sized accumulators, x-sized copies, one block —
    where differentiating the blockwise forward through autograd kept a copy of an expert's weights and
    the activations of every block (147 MiB here against this bound's 42)."""
    import torch

    from pipeline.models.nki import ops
    from pipeline.models.nki.constraints import MOE_BLOCK_SIZE

    experts, hidden, inter, rows = 8, 512, 256, 4096  # 23 blocks of 256 rows
    gen = torch.Generator().manual_seed(0)
    counts = torch.full((experts,), rows // experts)
    x = torch.randn(rows, hidden, generator=gen, requires_grad=True)
    weights = [torch.randn(s, generator=gen, requires_grad=True)
               for s in ((experts, inter, hidden), (experts, hidden, inter), (experts, inter, hidden))]
    with LiveBytes() as live:
        out = ops.experts(x, counts, *weights, False)
        grad = torch.ones_like(out)
        start = live.peak = live.now
        out.backward(grad)
    measured = live.peak - start
    bound = memory.experts_backward_bytes(sum(w.numel() for w in weights), rows, hidden, inter, 4, MOE_BLOCK_SIZE)
    assert measured <= 1.1 * bound, (measured / 2**20, bound / 2**20)
    assert measured > 0.5 * bound  # the tracker saw the backward (it ran in this thread, under the mode)
    assert x.grad is not None and all(w.grad is not None for w in weights)


def test_nki_moe_estimate_counts_the_experts_backward():
    arch = _arch("Qwen3-MoE-trn2-fit")
    nki = memory.estimate(arch, _trn2("nki"), "nki", "trn2")
    native = memory.estimate(arch, _trn2(), "native", "trn2")
    assert "experts backward" in nki.parts and "experts backward" not in native.parts
    layer_experts = arch.layer_params()["experts"] / 4  # TP 4 shards each expert's hidden dim
    assert 2 * layer_experts <= nki.parts["experts backward"] <= 2 * layer_experts + GIB  # bf16 accumulators
    no_moe_kernel = memory.estimate(arch, _trn2("nki", nki_overrides=["rope"]), "nki", "trn2")
    assert "experts backward" not in no_moe_kernel.parts


def test_a_plan_that_fits_is_chosen_and_said_when_the_configured_one_does_not():
    """issue 17, 3.6: the configured plan when it fits; else the first of the pipeline's candidates that
    does (smaller TP degrees, full activation checkpointing), with a line naming it; else a refusal
    naming the node count on which one fits."""
    arch = _arch("Qwen3-30B-A3B")
    native = _trn2()
    assert memory.fit(arch, native, "native", "trn2") == (native, None)
    two_nodes = _trn2("hf", nnodes=2)
    chosen, note = memory.fit(arch, two_nodes, "hf", "trn2")
    assert (chosen.tensor_parallel, chosen.activation_checkpoint, chosen.nnodes) == (4, "full", 2)
    assert memory.check(arch, chosen, "hf", "trn2").fits and "the pipeline chose TP 4 × FSDP 32" in note
    one_node = _trn2("hf")
    assert memory.fit(arch, one_node, "hf", "trn2") == (one_node, None)
    tp1_full = memory.estimate(arch, replace(one_node, tensor_parallel=1, activation_checkpoint="full"), "hf", "trn2")
    assert 21.6 * GIB < tp1_full.total < 23 * GIB  # the smallest one-node plan, just over the usable 90 %
    with pytest.raises(PipelineError, match=r"fits on 1 node\(s\)\. Fix: .*NNODES=2 \(the pipeline then chooses"):
        memory.check(arch, one_node, "hf", "trn2")
    # the candidates keep a data_parallel_shard the config fixed: TP then stays as configured
    fixed = [c.tensor_parallel for c in memory.plan_candidates(_trn2(data_parallel_shard=16))]
    assert fixed == [4, 4] and [c.tensor_parallel for c in memory.plan_candidates(native)] == [4, 4, 2, 2, 1, 1]
