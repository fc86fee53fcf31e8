"""The training paths, torchtitan-style: one registry entry per path; no other module knows the list.

An entry says how the path's model is described to torchtitan (inside each rank; pipeline.titan.model_spec
turns the description into what the installed torchtitan takes), which torchtitan
`override.imports` it takes on which target, and its optional launcher-side preparation (the nki
path picks kernels and checks their constraints). Importable without torch: builders import what
they need when called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline.checkpoint.arch import Qwen3Arch
from pipeline.errors import PipelineError
from pipeline.models import attention_backends, lora
from pipeline.run.settings import TrainSettings, closest
from pipeline.run.spec import RunSpec

# FlexAttention has no CPU backward and GroupedExperts is bf16-only: see models/cpu_overrides.py.
CPU_ATTENTION = "pipeline.models.cpu_overrides.dense_mask_attention"
CPU_EXPERTS = "pipeline.models.cpu_overrides.loop_experts"


@dataclass(frozen=True)
class PlanLandmarks:
    """Where a path's model shows its parallel plan (module and parameter names, wrappers left out),
    read by the rehearsal's checks (pipeline.training.rehearsal.check_plan)."""

    embedding: str  # its output is the residual stream: a sequence shard under SP
    head: str  # the output projection: sees the full sequence, gives vocab-sharded logits
    block: str  # the first transformer block: its input is the residual stream (a sequence shard under SP)
    norm: str  # the block's first norm: runs on the sequence shard under SP
    attention_input: str  # the module that projects q/k/v: sees the full sequence
    colwise: str  # a column-parallel weight: Shard(0) on tp
    rowwise: str  # a row-parallel weight: Shard(1) on tp


NATIVE_LANDMARKS = PlanLandmarks(
    embedding="tok_embeddings", head="lm_head", block="layers.0", norm="layers.0.attention_norm",
    attention_input="layers.0.attention.qkv_linear", colwise="layers.0.attention.qkv_linear.wqkv.weight",
    rowwise="layers.0.attention.wo.weight")
HF_LANDMARKS = PlanLandmarks(
    embedding="model.embed_tokens", head="lm_head", block="model.layers.0", norm="model.layers.0.input_layernorm",
    attention_input="model.layers.0.self_attn.q_proj", colwise="model.layers.0.self_attn.q_proj.weight",
    rowwise="model.layers.0.self_attn.o_proj.weight")


@dataclass(frozen=True)
class TensorParallelPlan:
    """What a path's tensor-parallel plan does, in the terms of Qwen3Arch.param_counts(): the parts
    it divides over the tp ranks (the others stay whole on each), whether it runs sequence
    parallelism when the settings ask for it, and whether its logits (and the loss) stay sharded over
    the vocabulary. The memory estimate reads it (pipeline.training.memory); each path's tests
    compare it with the plan the path applies (tests/training/test_training_memory.py)."""

    sharded: tuple[str, ...]
    sequence_parallel: bool
    vocab_parallel_loss: bool


# torchtitan's Qwen3 sharding (models/qwen3/sharding.py): attention, dense FFN, routed experts (on
# their hidden dim), embedding and lm_head (vocab); norms and the router replicated.
NATIVE_TP_PLAN = TensorParallelPlan(("attention", "mlp", "experts", "embedding", "lm_head"), True, True)
# models/hf/parallelize.py's root_tp_plan and layer_tp_plan: the same Megatron layout for attention, the dense MLP,
# the embedding and lm_head (vocab-sharded logits, vocab-parallel loss) and sequence parallelism;
# Qwen3-MoE's experts and router replicated (one fused tensor per projection, routed by index ops).
HF_TP_PLAN = TensorParallelPlan(("attention", "mlp", "embedding", "lm_head"), True, True)


@dataclass(frozen=True)
class LoraSupport:
    """How a path's model takes LoRA adapters (lora_rank > 0; pipeline.models.lora): what makes them, the names
    they get in the model (a key of pipeline.titan.lora.NAMES: what the trainer freezes around, merges and saves,
    and DPO's reference switches off), the modules they adapt for the run's settings (an unknown target is a
    PipelineError, raised before launch) and each module's in + out features (the memory estimate)."""

    made_by: str
    names: str
    targets: Callable[[TrainSettings, Qwen3Arch], list[str]]
    sizes: Callable[[Qwen3Arch], dict[str, int]]


TITAN_LORA = LoraSupport("torchtitan's LoRA converter", "titan", lora.targets, lora.native_sizes)
PEFT_LORA = LoraSupport("PEFT's LoRA layers", "peft", lora.hf_targets, lora.hf_sizes)


@dataclass(frozen=True)
class TrainingPath:
    name: str
    summary: str
    build: Callable[[RunSpec], object]  # RunSpec -> pipeline.titan.model_spec.ModelDescription
    overrides: Callable[[str, TrainSettings], tuple[str, ...]] = lambda target, settings: ()  # -> override.imports
    prepare: Callable[[RunSpec, bool], None] | None = None  # launcher side (spec, dry_run); no torch
    landmarks: PlanLandmarks = NATIVE_LANDMARKS
    tp_plan: TensorParallelPlan = NATIVE_TP_PLAN
    # Whether its MoE experts' backward is the blockwise reference's, computed block by block with
    # weight-sized accumulators (models/nki/layout.py, moe_cte_reference_backward): the memory
    # estimate adds that working set.
    blockwise_experts_backward: Callable[[TrainSettings], bool] = lambda settings: False
    # How its model takes LoRA adapters; None: it does not.
    lora: LoraSupport | None = TITAN_LORA
    # Whether the model's attention is torchtitan's, so attention_backend chooses it (transformers' own
    # modules run their own attention).
    titan_attention: bool = True
    # Whether each layer keeps a RoPE cache of seq_len × 2·head_dim float32 (torchtitan's CosSinRoPE, sized at the
    # run's seq_len: pipeline.models.native); transformers' rotary embedding keeps only inv_freq.
    rope_cache_per_layer: bool = True
    colour: str = "tab:gray"  # report: fixed per path so a path keeps its look from report to report
    line: tuple[str, str] = ("-", "o")


def _native(spec: RunSpec):
    from pipeline.models import native

    # FSDP on one rank shards nothing; it still casts parameters when they train in a lower precision.
    shard = spec.world_size > 1 or spec.settings.dtype != "float32"
    return lora.apply(native.describe(spec.arch, spec.model_key, spec.settings.seq_len,
                                      attention_backends.titan_backend(spec.settings.attention_backend), shard=shard),
                      spec.settings)


def _hf(spec: RunSpec):
    from pathlib import Path

    from pipeline.fsutil import read_json_object
    from pipeline.models import hf

    config = read_json_object(Path(spec.source_dir) / "config.json", "run `make download … FORCE=1`.")
    s = spec.settings
    adapters = (s.lora_rank, s.lora_alpha, tuple(lora.hf_targets(s, spec.arch))) if s.lora_rank > 0 else None
    return hf.describe(config, spec.model_key, s.seq_len, lora=adapters)


def _native_overrides(target: str, settings: TrainSettings) -> tuple[str, ...]:
    # The attention backend's kernel (document_sdpa on trn2), then what CPU needs; the dense-mask
    # CPU attention replaces FlexAttention and so only comes with the flex backend.
    attention = attention_backends.override_for(settings.attention_backend)
    cpu = (CPU_ATTENTION, CPU_EXPERTS) if target == "cpu" else ()
    if settings.attention_backend != "flex":
        cpu = tuple(o for o in cpu if o != CPU_ATTENTION)
    return ((attention,) if attention else ()) + cpu


def _nki_overrides(target: str, settings: TrainSettings) -> tuple[str, ...]:
    # nki_experts claims GroupedExperts itself, and its reference dispatch is loop_experts' per-expert loop.
    replaced = {CPU_EXPERTS} if "moe" in settings.nki_overrides else set()
    return tuple(o for o in _native_overrides(target, settings) if o not in replaced)


def _prepare_hf(spec: RunSpec, dry_run: bool) -> None:
    s = spec.settings
    if s.compile and s.tensor_parallel > 1:
        # Found by `make rehearse`: transformers' Qwen3 with the TP plan's ParallelStyles, compiled
        # per block, trains with a step-1 gradient norm 2.7 % off the plain run even in float32 (loss
        # exact; eager and the native path compiled agree). Refused rather than trained wrong.
        raise PipelineError("the hf path's tensor-parallel plan computes wrong gradients under torch.compile "
                            f"(compile = true with tensor_parallel = {s.tensor_parallel}).",
                            "set compile = false for the hf path ([paths.hf] in the config) or tensor_parallel = 1.")
    if s.lora_rank > 0 and s.tensor_parallel > 1:
        # The TP plan's ParallelStyles take nn.Linear; PEFT's LoRA layer wraps one (base_layer, lora_A, lora_B)
        # and would need its own plan for the adapters, which nothing here has been checked against.
        raise PipelineError(f"LoRA on the hf path has no tensor-parallel plan for PEFT's adapter layers "
                            f"(lora_rank = {s.lora_rank} with tensor_parallel = {s.tensor_parallel}).",
                            "set tensor_parallel = 1 for the hf path (FSDP still shards it), or train LoRA with "
                            "TP on the native path.")


def _prepare_nki(spec: RunSpec, dry_run: bool) -> None:
    from pipeline.models.nki import prepare

    prepare.prepare(spec, dry_run)


PATHS: dict[str, TrainingPath] = {
    p.name: p
    for p in (
        TrainingPath("hf", "Transformers v5's own Qwen3 (AutoModelForCausalLM from config.json) trained by torchtitan",
                     _hf, prepare=_prepare_hf, landmarks=HF_LANDMARKS, tp_plan=HF_TP_PLAN, lora=PEFT_LORA, titan_attention=False,
                     rope_cache_per_layer=False,
                     colour="tab:blue",
                     line=("-", "o")),
        TrainingPath("native", "torchtitan's own Qwen3 (dense and MoE)", _native, overrides=_native_overrides,
                     colour="tab:orange", line=("--", "s")),
        # Same model as native: the NKI modules come in through override.imports, so parameter
        # names, checkpoints and the export stay native's.
        TrainingPath("nki", "native Qwen3 with NKI kernels (RoPE, MoE) via torchtitan's override registry", _native,
                     overrides=_nki_overrides, prepare=_prepare_nki,
                     blockwise_experts_backward=lambda settings: "moe" in settings.nki_overrides,
                     colour="tab:green", line=(":", "^")),
    )
}


def names() -> tuple[str, ...]:
    return tuple(PATHS)


def get(name: str) -> TrainingPath:
    if name not in PATHS:
        raise PipelineError(f"training path {name!r} is unknown{closest(name, PATHS)}; known: {', '.join(PATHS)}.",
                            "pick one of them.")
    return PATHS[name]
