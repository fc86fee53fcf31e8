"""torchtitan's own Qwen3, built with the shapes of a checkpoint's config.json.

torchtitan only ships named flavors; its builders for a flavor's layers are private (reached
through pipeline.titan.accessors; pipeline.titan.internals checks they exist). We call them with
the checkpoint's numbers so the layer/parameter-init conventions stay torchtitan's own.
"""

from __future__ import annotations

from pipeline.checkpoint.arch import TITAN_RMS_NORM_EPS, Qwen3Arch
from pipeline.titan import accessors
from pipeline.titan.model_spec import ModelDescription, context_kwargs, optional_name, rope_config


def model_config(arch: Qwen3Arch, attn_backend: str = "flex", *, max_context_length: int):
    """The model config, its RoPE caches `max_context_length` (the run's seq_len) long: torchtitan after #4328
    keeps them as built (at max_position_embeddings, 262,144 positions for the 4B: ~9 GiB per rank)."""
    from torchtitan.models import qwen3 as titan_qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    rope = rope_config(CosSinRoPE, dim=arch.head_dim, max_len=max_context_length, theta=arch.rope_theta)
    common = dict(
        fuse_qkv=True,
        n_layers=arch.num_hidden_layers,
        dim=arch.hidden_size,
        n_heads=arch.num_attention_heads,
        n_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        attn_backend=attn_backend,
        rope=rope,
    )
    if arch.is_moe:
        layers = accessors.qwen3_moe_layers(
            **common,
            moe_hidden_dim=arch.moe_intermediate_size,
            num_experts=arch.num_experts,
            top_k=arch.num_experts_per_tok,
            moe_comm_backend="standard",
        )
        for layer in layers:
            # Qwen3-MoE has no auxiliary-loss-free expert bias; torchtitan's default (1e-3)
            # would add one that the Hugging Face model and the export know nothing of.
            layer.moe.load_balance_coeff = None
    else:
        layers = accessors.qwen3_layers(**common, hidden_dim=arch.intermediate_size)
    assert accessors.qwen3_eps() == TITAN_RMS_NORM_EPS
    inits = accessors.qwen3_inits(arch.tie_word_embeddings)
    return titan_qwen3.Qwen3Model.Config(
        **context_kwargs(titan_qwen3.Qwen3Model.Config, max_context_length),
        vocab_size=arch.vocab_size,
        dim=arch.hidden_size,
        norm=accessors.qwen3_norm(arch.hidden_size),
        enable_weight_tying=arch.tie_word_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=arch.vocab_size,
            embedding_dim=arch.hidden_size,
            param_init=inits["embedding"],
        ),
        lm_head=Linear.Config(in_features=arch.hidden_size, out_features=arch.vocab_size,
                              param_init=inits["lm_head"]),
        layers=layers,
    )


def describe(arch: Qwen3Arch, name: str, seq_len: int, attn_backend: str = "flex", shard: bool = True) -> ModelDescription:
    """`shard=False` skips FSDP: torchtitan's parallelize_qwen3 wraps the model in FSDP2 even on one
    rank, where there is nothing to shard and, with parameters already in the compute dtype, nothing
    to cast; it then only copies every parameter and gradient in and out of flat buffers each step
    (measured: ~20 % of a tiny-model CPU step). Checkpoints hold the same keys and values either way."""
    import functools

    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter

    # per-model parallelize.py is gone after #4810 (Qwen3Model parallelizes itself; FSDP then also on one rank)
    parallelize_qwen3 = optional_name("torchtitan.models.qwen3", "parallelize_qwen3")
    if parallelize_qwen3 is not None and not shard:
        parallelize_qwen3 = functools.partial(parallelize_qwen3, skip_dp=True)
    return ModelDescription(
        name="qwen3",
        flavor=name,
        model=model_config(arch, attn_backend, max_context_length=seq_len),
        max_context_length=seq_len,
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=register_moe_load_balancing_hook if arch.is_moe else None,
        state_dict_adapter=Qwen3StateDictAdapter,
    )
