"""Estimate of device memory per rank for a resolved run, checked against the device's capacity.

First-order, from the architecture and the parallel plan alone (no torch): parameters in float32
(torchtitan keeps fp32 masters and casts to the training dtype for compute), gradients in float32,
AdamW's two float32 states, all three sharded by FSDP over the data-parallel ranks and by TP where the
path's plan shards them; FSDP's working set (one unit all-gathered in the compute dtype, the next
prefetched, and one unit's unsharded float32 gradients); activations at the chosen checkpointing,
sequence length and local batch; the logits and the float32 log-softmax of the loss. Not modelled:
the runtime's and collectives' own buffers, compiler scratch and allocator fragmentation — hence
HEADROOM. tests/test_training_memory.py and bench/memory_estimate.py compare it with measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.checkpoint.arch import Qwen3Arch
from pipeline.errors import PipelineError
from pipeline.run.settings import TrainSettings

GIB = 2**30
# trn2.48xlarge: 16 Trainium2 chips × 96 GiB HBM; at LNC=2 a chip is 4 logical NeuronCores, so
# ~24 GiB per rank (shared/notes/neuron.md; LNC=1 halves the core and its share).
TRN2_HBM_PER_CHIP = 96 * GIB
TRN2_PHYSICAL_CORES_PER_CHIP = 8
# Fraction of the capacity a plan may fill: the Neuron runtime, collective buffers and compiled
# graphs live in the same HBM and are not modelled here.
HEADROOM = 0.9
BYTES = {"float32": 4, "bfloat16": 2}
# On CPU each rank is also a process holding torch, torchtitan, the tokenizer and the data pipeline:
# measured RSS of a rank after its imports, before the model exists (issue 14). Added on top of the
# estimate where ranks share the host's memory (the launcher's check, memory.json).
CPU_PROCESS_GIB = 0.8


def capacity_per_rank(target: str, lnc: int) -> int | None:
    if target == "trn2":
        return TRN2_HBM_PER_CHIP * lnc // TRN2_PHYSICAL_CORES_PER_CHIP
    return None  # CPU: host memory; CUDA: not estimated against (the GPU is whatever is there)


@dataclass(frozen=True)
class Plan:
    """Which parameter groups TP shards, and what the path does with activations."""

    tp_sharded: tuple[str, ...]  # parts of Qwen3Arch.param_counts() that TP divides
    sequence_parallel: bool
    vocab_parallel_loss: bool  # logits sharded over TP (torchtitan's loss-parallel CE)


def plan_for(path: str, settings: TrainSettings) -> Plan:
    tp = settings.tensor_parallel
    if path == "hf":
        # models/hf.py's TP plan: attention and the dense MLP only; embeddings, norms, router and experts
        # stay whole on every TP rank, and it has no sequence parallelism.
        return Plan(("attention", "mlp"), False, False)
    # torchtitan's Qwen3 sharding (models/qwen3/sharding.py): attention, dense FFN, routed experts
    # (on their hidden dim), embedding and lm_head (vocab); norms and the router replicated.
    return Plan(("attention", "mlp", "experts", "embedding", "lm_head"), settings.sequence_parallel and tp > 1, True)


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


def estimate(arch: Qwen3Arch, settings: TrainSettings, path: str, target: str) -> MemoryEstimate:
    tp = settings.tensor_parallel
    dp = settings.world_size // tp
    plan = plan_for(path, settings)
    counts = arch.param_counts()
    per_tp_rank = sum(v / tp if k in plan.tp_sharded else v for k, v in counts.items())
    params_rank = per_tp_rank / dp
    compute = BYTES[settings.dtype]
    adapters = lora_params(arch, settings) / dp if settings.lora_rank else 0.0
    trained = adapters if settings.lora_rank else params_rank  # LoRA: gradients and AdamW state for adapters only
    parts = {
        "parameters": 4 * (params_rank + adapters),
        "gradients": 4 * trained,
        "optimizer": 8 * trained,
    }
    # FSDP units: each layer, the embedding, the lm_head (tied: one). Gathered in the compute dtype,
    # the next one prefetched; one unit's float32 gradients before the reduce-scatter.
    layer = sum(v / tp if k in plan.tp_sharded else v for k, v in arch.layer_params().items())
    vocab_tp = tp if "embedding" in plan.tp_sharded else 1
    ends = arch.vocab_size * arch.hidden_size / vocab_tp
    largest = max(layer, ends)
    parts["fsdp buffers"] = 2 * compute * largest + 4 * largest if dp > 1 else 0.0
    tokens = settings.local_batch_size * settings.seq_len
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
    notes = [f"TP {tp} × FSDP {dp}; {'SP; ' if plan.sequence_parallel else ''}activation checkpointing "
             f"{settings.activation_checkpoint}; seq_len {settings.seq_len} × local batch {settings.local_batch_size}"
             + (f"; LoRA rank {settings.lora_rank}: gradients and optimizer state for "
                f"{lora_params(arch, settings):,} adapter parameters" if settings.lora_rank else "")]
    return MemoryEstimate(parts, capacity_per_rank(target, settings.lnc), notes)


def lora_params(arch: Qwen3Arch, settings: TrainSettings) -> int:
    """Adapter parameters of a LoRA run: rank × (in + out) per adapted projection (pipeline.models.lora;
    wqkv is one fused projection; MoE experts are no Linear and get none)."""
    from pipeline.models import lora

    h, hd, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    qkv = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * hd
    sizes = {"wqkv": h + qkv, "wo": arch.num_attention_heads * hd + h}
    if not arch.is_moe:
        sizes |= {"w1": h + inter, "w2": inter + h, "w3": h + inter}
    return settings.lora_rank * arch.num_hidden_layers * sum(sizes.get(t, 0) for t in lora.targets(settings))


def check(arch: Qwen3Arch, settings: TrainSettings, path: str, target: str) -> MemoryEstimate:
    """The estimate, or a one-line refusal when it cannot fit the device."""
    result = estimate(arch, settings, path, target)
    if not result.fits:
        largest = max(result.parts, key=result.parts.get)
        # The hf path's TP plan leaves MoE experts and the embeddings whole on every TP rank.
        other_path = "train it on the native path (its TP plan shards experts and embeddings), or " \
            if path == "hf" and arch.is_moe else ""
        raise PipelineError(
            f"the {path} path needs ~{result.total / GIB:.1f} GiB per rank, more than the {result.usable / GIB:.1f} GiB "
            f"usable of the {result.capacity / GIB:.0f} GiB a rank has on {target} at LNC={settings.lnc} (largest: "
            f"{largest} {result.parts[largest] / GIB:.1f} GiB; {result.notes[0]}).",
            f"{other_path}raise tensor_parallel (within a chip) or the number of nodes, lower SEQ_LEN or "
            'local_batch_size, or set activation_checkpoint = "full".')
    return result


def host_need(spec) -> int:
    """Bytes this launch's ranks need together from this host's memory (CPU: the estimate plus each
    process's own); what decides the glibc thresholds (pipeline.run.targets)."""
    per_rank = spec.memory["total_gib"] + (CPU_PROCESS_GIB if spec.target == "cpu" else 0.0)
    return int(per_rank * GIB * spec.settings.nproc_per_node)
