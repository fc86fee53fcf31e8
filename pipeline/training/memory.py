"""Estimate of device memory per rank for a resolved run, checked against the device's capacity.

First-order, from the architecture and the parallel plan alone (no torch): parameters in float32
(torchtitan keeps fp32 masters and casts to the training dtype for compute), gradients in float32,
AdamW's two float32 states, all three sharded by FSDP over the data-parallel ranks and by TP where the
path's plan shards them; FSDP's working set (one unit all-gathered in the compute dtype, the next
prefetched, and one unit's unsharded float32 gradients); activations at the chosen checkpointing,
sequence length and local batch; the logits and the float32 log-softmax of the loss; where a path's
MoE experts backward runs block by block (nki), its working set (experts_backward_bytes); each layer's
float32 RoPE cache of seq_len positions where the path's model keeps one (torchtitan's RoPE); on trn2 the
Neuron runtime's microcode reserve (96 MB per physical core: 192 MB per rank at LNC=2). Not modelled: the
runtime's scratchpad, DMA rings and collective buffers, compiler scratch and allocator fragmentation —
hence HEADROOM. tests/training/test_training_memory.py and bench/memory_estimate.py compare it with measured peaks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from pipeline.dtypes import DTYPES
from pipeline.checkpoint.arch import Qwen3Arch
from pipeline.errors import PipelineError
from pipeline.models import registry
from pipeline.models.nki.constraints import MOE_BLOCK_SIZE
from pipeline.run.settings import TrainSettings
from pipeline.run.targets import TRN2

GIB = 2**30
# Fraction of the capacity a plan may fill: the Neuron runtime, collective buffers and compiled
# graphs live in the same HBM and are not modelled here.
HEADROOM = 0.9
# On CPU each rank is also a process holding torch, torchtitan, the tokenizer and the data pipeline:
# measured RSS of a rank after its imports, before the model exists (issue 14). Added on top of the
# estimate where ranks share the host's memory (the launcher's check, memory.json).
CPU_PROCESS_GIB = 0.8


def capacity_per_rank(target: str, lnc: int) -> int | None:
    if target == "trn2":
        return TRN2.hbm_per_rank(lnc)  # 24 GiB at LNC=2: a chip's 96 GiB over its 4 logical cores
    return None  # CPU: host memory; CUDA: not estimated against (the GPU is whatever is there)


@dataclass(frozen=True)
class Plan:
    """The path's tensor-parallel plan (its registry entry's TensorParallelPlan) under these settings."""

    tp_sharded: tuple[str, ...]  # parts of Qwen3Arch.param_counts() that TP divides
    sequence_parallel: bool
    vocab_parallel_loss: bool  # logits sharded over TP (torchtitan's loss-parallel CE)


def plan_for(path: str, settings: TrainSettings) -> Plan:
    declared = registry.get(path).tp_plan
    tp = settings.tensor_parallel
    return Plan(declared.sharded, declared.sequence_parallel and settings.sequence_parallel and tp > 1,
                declared.vocab_parallel_loss)


@dataclass
class MemoryEstimate:
    parts: dict[str, float]  # bytes per rank
    capacity: int | None
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def usable(self) -> float | None:
        return None if self.capacity is None else self.capacity * HEADROOM

    @property
    def fits(self) -> bool:
        return self.usable is None or self.total <= self.usable

    def summary(self) -> str:
        parts = ", ".join(f"{name} {value / GIB:.2f}" for name, value in self.parts.items())
        against = (f" of {self.capacity / GIB:.0f} GiB ({HEADROOM:.0%} usable: {self.usable / GIB:.1f})"
                   if self.capacity else "")
        return f"HBM per rank (estimate): {self.total / GIB:.2f} GiB{against} = {parts} GiB"

    def to_dict(self) -> dict:
        return {"total_gib": self.total / GIB, "capacity_gib": self.capacity / GIB if self.capacity else None,
                "usable_gib": self.usable / GIB if self.usable else None, "fits": self.fits,
                "parts_gib": {k: v / GIB for k, v in self.parts.items()}, "notes": self.notes}


def _layer_activations(arch: Qwen3Arch, settings: TrainSettings, plan: Plan, tp: int) -> tuple[float, float]:
    """(elements saved per token per layer without checkpointing, of which matmul outputs)."""
    h, hd, s = arch.hidden_size, arch.head_dim, settings.seq_len
    heads_tp, kv_tp = arch.num_attention_heads / tp, arch.num_key_value_heads / tp
    h_sp = h / tp if plan.sequence_parallel else h  # norms and residual stream under SP
    qkv = (heads_tp + 2 * kv_tp) * hd
    attention = (h_sp + h  # norm input, the gathered qkv input
                 + qkv + 2 * (heads_tp + kv_tp) * hd  # q/k/v, q/k-norm inputs and rotated q/k
                 + heads_tp * hd  # attention output (o_proj input)
                 + heads_tp * s)  # probabilities: every path's attention here materialises the scores
    if arch.is_moe:
        tp_e = tp if "experts" in plan.tp_sharded else 1
        k, inter = arch.num_experts_per_tok, arch.moe_intermediate_size / tp_e
        ffn = h_sp + h + arch.num_experts + k * (2 * h + 4 * inter)
        matmuls = qkv + h_sp + k * (2 * inter + h)
    else:
        ffn = h_sp + h + 4 * arch.intermediate_size / tp
        matmuls = qkv + h_sp + 2 * arch.intermediate_size / tp + h_sp
    return attention + ffn, matmuls


def estimate(arch: Qwen3Arch, settings: TrainSettings, path: str, target: str, dpo: bool = False) -> MemoryEstimate:
    """`dpo`: a DPO run (preference data, pipeline.titan.dpo): every pair is two rows (chosen, rejected), and full
    fine-tuning keeps the reference model, a float32 copy of each rank's parameter shards (LoRA's reference is the
    base with its adapters off: no copy)."""
    tp = settings.tensor_parallel
    dp = settings.world_size // tp
    plan = plan_for(path, settings)
    counts = arch.param_counts()
    per_tp_rank = sum(v / tp if k in plan.tp_sharded else v for k, v in counts.items())
    params_rank = per_tp_rank / dp
    compute = DTYPES[settings.dtype].bytes
    adapters = lora_params(arch, settings, path) / dp if settings.lora_rank else 0.0
    trained = adapters if settings.lora_rank else params_rank  # LoRA: gradients and AdamW state for adapters only
    parts = {
        "parameters": 4 * (params_rank + adapters),
        "gradients": 4 * trained,
        "optimizer": 8 * trained,
    }
    if dpo and not settings.lora_rank:
        parts["reference model"] = 4 * params_rank
    # FSDP units: each layer, the embedding, the lm_head (tied: one). Gathered in the compute dtype,
    # the next one prefetched; one unit's float32 gradients before the reduce-scatter.
    layer = sum(v / tp if k in plan.tp_sharded else v for k, v in arch.layer_params().items())
    vocab_tp = tp if "embedding" in plan.tp_sharded else 1
    ends = arch.vocab_size * arch.hidden_size / vocab_tp
    largest = max(layer, ends)
    parts["fsdp buffers"] = 2 * compute * largest + 4 * largest if dp > 1 else 0.0
    tokens = settings.local_batch_size * settings.seq_len * (2 if dpo else 1)
    full_layer, matmuls = _layer_activations(arch, settings, plan, tp)
    h_sp = arch.hidden_size / tp if plan.sequence_parallel else arch.hidden_size
    saved = {"none": full_layer, "selective": h_sp + matmuls / 2, "full": h_sp}[settings.activation_checkpoint]
    # Saved activations of every layer, plus one layer's full set while it is recomputed/differentiated.
    transient = full_layer if settings.activation_checkpoint != "none" else 0.0
    parts["activations"] = compute * tokens * (arch.num_hidden_layers * saved + transient)
    vocab = arch.vocab_size / (tp if plan.vocab_parallel_loss else 1)
    # lm_head output in the compute dtype; in the loss: its float32 copy (bf16) or log-softmax input,
    # the float32 log-softmax, and in backward the float32 gradients of both (measured on CPU, fp32:
    # 4 vocab-sized float32 tensors alive at the peak).
    parts["logits"] = tokens * vocab * (compute + 12)
    if registry.get(path).rope_cache_per_layer:
        # one cos|sin cache per layer, [seq_len, 2·head_dim] float32, a buffer on every rank (not sharded)
        parts["rope caches"] = arch.num_hidden_layers * settings.seq_len * 2 * arch.head_dim * 4
    if target == "trn2":
        parts["runtime reserve"] = TRN2.runtime_reserve_per_rank(settings.lnc)
    if arch.is_moe and registry.get(path).blockwise_experts_backward(settings):
        tp_e = tp if "experts" in plan.tp_sharded else 1
        parts["experts backward"] = experts_backward_bytes(
            arch.layer_params()["experts"] / tp_e, tokens * arch.num_experts_per_tok, arch.hidden_size,
            arch.moe_intermediate_size / tp_e, compute)
    notes = [f"TP {tp} × FSDP {dp}; {'SP; ' if plan.sequence_parallel else ''}activation checkpointing "
             f"{settings.activation_checkpoint}; seq_len {settings.seq_len} × local batch {settings.local_batch_size}"
             + (f"; LoRA rank {settings.lora_rank}: gradients and optimizer state for "
                f"{lora_params(arch, settings, path):,} adapter parameters" if settings.lora_rank else "")
             + ("; DPO: 2 rows per pair" + ("" if settings.lora_rank else ", the reference model's weights") if dpo else "")]
    return MemoryEstimate(parts, capacity_per_rank(target, settings.lnc), notes)


def experts_backward_bytes(expert_params: float, rows: float, hidden: int, inter: float, compute: int,
                           block_size: int = MOE_BLOCK_SIZE) -> float:
    """Working set of one MoE layer's blockwise experts backward (models/nki/layout.py,
    moe_cte_reference_backward) beyond its inputs: gradient accumulators for the layer's expert weights
    and for x in the compute dtype (the gradients it returns), x and the incoming gradient padded with
    moe_cte's zero row, and one block's weights and activations. Measured on CPU by
    tests/training/test_training_memory.py."""
    block = compute * (4 * hidden * inter + block_size * (3 * hidden + 8 * inter))
    return compute * expert_params + 3 * compute * (rows + 1) * hidden + block


def plan_candidates(settings: TrainSettings):
    """The plans the pipeline may choose instead of the configured one, in order of preference: the
    configured TP degree, then each smaller divisor of it (each still divides the ranks, the heads and
    the sequence, which the configured degree was checked to do), each with the configured activation
    checkpointing and then with "full". TP is only changed where FSDP takes every remaining rank."""
    degrees = [d for d in range(settings.tensor_parallel, 0, -1) if settings.tensor_parallel % d == 0]
    if settings.data_parallel_shard != -1:
        degrees = degrees[:1]
    modes = dict.fromkeys((settings.activation_checkpoint, "full"))
    for degree in degrees:
        for mode in modes:
            yield replace(settings, tensor_parallel=degree, activation_checkpoint=mode)


def fit(arch: Qwen3Arch, settings: TrainSettings, path: str, target: str,
        dpo: bool = False) -> tuple[TrainSettings, str | None]:
    """The configured settings when their plan fits (or the target's capacity is not estimated against),
    else the first of plan_candidates that fits, with a line saying what was chosen and why; the
    configured settings again when none fits (check() then refuses)."""
    configured = estimate(arch, settings, path, target, dpo)
    if configured.fits:
        return settings, None
    for candidate in plan_candidates(settings):
        result = estimate(arch, candidate, path, target, dpo)
        if result.fits:
            return candidate, (f"the configured plan ({configured.notes[0]}) needs ~{configured.total / GIB:.1f} GiB per "
                               f"rank, over the {configured.usable / GIB:.1f} GiB usable on {target}; the pipeline "
                               f"chose {result.notes[0]} (~{result.total / GIB:.1f} GiB).")
    return settings, None


def _more_nodes(arch: Qwen3Arch, settings: TrainSettings, path: str, target: str, dpo: bool = False) -> str:
    """'NNODES=n (…), or ' for the fewest nodes (up to 16× these) on which a candidate plan fits, or ''."""
    for nodes in (settings.nnodes * k for k in (2, 4, 8, 16)):
        more, _ = fit(arch, replace(settings, nnodes=nodes), path, target, dpo)
        result = estimate(arch, more, path, target, dpo)
        if result.fits:
            return f"run on NNODES={nodes} (the pipeline then chooses {result.notes[0]}: ~{result.total / GIB:.1f} GiB), or "
    return ""


def _smaller_plan(arch: Qwen3Arch, settings: TrainSettings, path: str, target: str, dpo: bool = False) -> str:
    chosen, _ = fit(arch, settings, path, target, dpo)
    if chosen is settings:
        return f", and no smaller TP degree or activation checkpointing mode fits on {settings.nnodes} node(s)"
    return f"; {estimate(arch, chosen, path, target, dpo).notes[0]} would fit"


def lora_params(arch: Qwen3Arch, settings: TrainSettings, path: str) -> int:
    """Adapter parameters of a LoRA run: rank × (in + out) per adapted projection, in the path's own modules
    (registry.LoraSupport: native's wqkv is one fused projection, hf's q/k/v three; MoE experts are no Linear and
    get none)."""
    support = registry.get(path).lora
    if support is None:
        return 0
    sizes = support.sizes(arch)
    return settings.lora_rank * arch.num_hidden_layers * sum(sizes.get(t, 0) for t in support.targets(settings, arch))


def check(arch: Qwen3Arch, settings: TrainSettings, path: str, target: str, dpo: bool = False) -> MemoryEstimate:
    """The estimate, or a one-line refusal when it cannot fit the device."""
    result = estimate(arch, settings, path, target, dpo)
    if not result.fits:
        largest = max(result.parts, key=result.parts.get)
        other_path = ""
        if arch.is_moe and "experts" not in plan_for(path, settings).tp_sharded:
            # this path's TP plan leaves the experts whole on every TP rank: name a path whose plan does not
            sharding = [p for p in registry.names() if "experts" in registry.get(p).tp_plan.sharded]
            other_path = f"train it on the {sharding[0]} path (its TP plan shards the experts), or " if sharding else ""
        raise PipelineError(
            f"the {path} path needs ~{result.total / GIB:.1f} GiB per rank, more than the {result.usable / GIB:.1f} GiB "
            f"usable of the {result.capacity / GIB:.0f} GiB a rank has on {target} at LNC={settings.lnc} (largest: "
            f"{largest} {result.parts[largest] / GIB:.1f} GiB; {result.notes[0]}){_smaller_plan(arch, settings, path, target, dpo)}.",
            f"{other_path}{_more_nodes(arch, settings, path, target, dpo)}lower SEQ_LEN or local_batch_size, or raise "
            "tensor_parallel (within a chip).")
    return result


def host_need(spec) -> int:
    """Bytes this launch's ranks need together from this host's memory (CPU: the estimate plus each
    process's own); what decides the glibc thresholds (pipeline.run.targets)."""
    per_rank = spec.memory["total_gib"] + (CPU_PROCESS_GIB if spec.target == "cpu" else 0.0)
    return int(per_rank * GIB * spec.settings.nproc_per_node)


def host_memory_bytes() -> int:
    """This host's physical memory, or the memory limit of the cgroup the launcher runs in when smaller
    (a container's --memory, a Slurm job's allocation): what the ranks of one node share on CPU."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # cgroup v2 (docs.kernel.org/admin-guide/cgroup-v2.html: memory.max, "max" when unlimited)
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        return min(physical, int(limit)) if limit.isdigit() else physical
    except OSError:
        return physical


def check_host(spec, force: bool = False) -> str | None:
    """CPU: the node's ranks share its memory. A run needing more than the host has is refused before
    launch (it would be killed by the kernel's out-of-memory killer part way); FORCE=1 launches it,
    with the warning returned (None when it fits, or off CPU, where check() compared with the device)."""
    if spec.target != "cpu":
        return None
    need, have = host_need(spec), host_memory_bytes()
    if need <= have:
        return None
    problem = (f"{spec.settings.nproc_per_node} rank(s) need about {need / GIB:.1f} GiB on this host (the estimate, "
               f"{spec.memory['total_gib']:.2f} GiB per rank, plus {CPU_PROCESS_GIB} GiB for each process) and it has "
               f"{have / GIB:.1f} GiB")
    if force:
        return f"warning: {problem}; launching anyway (FORCE=1): the kernel may kill a rank."
    raise PipelineError(f"{problem}: the kernel would kill a rank part way.",
                        "lower NPROC (NPROC=1 needs least), SEQ_LEN or local_batch_size, set activation_checkpoint = "
                        "\"full\" in CONFIG, or pass FORCE=1 to launch anyway.")
