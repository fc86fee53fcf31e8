"""torchtitan's own Qwen3, built with the shapes of a checkpoint's config.json.

torchtitan only ships named flavors; its builders for a flavor's layers are private (reached
through pipeline.titan.accessors; pipeline.titan.internals checks they exist). We call them with
the checkpoint's numbers so the layer/parameter-init conventions stay torchtitan's own.
"""

from __future__ import annotations

from pipeline.checkpoint.arch import TITAN_RMS_NORM_EPS, Qwen3Arch
from pipeline.titan import accessors, api


def model_config(arch: Qwen3Arch, attn_backend: str = "flex"):
    from torchtitan.models import qwen3 as titan_qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    rope = api.rope_config(CosSinRoPE, dim=arch.head_dim, max_len=arch.max_position_embeddings, theta=arch.rope_theta)
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


def model_spec(arch: Qwen3Arch, name: str, attn_backend: str = "flex", shard: bool = True):
    """`shard=False` skips FSDP: torchtitan's parallelize_qwen3 wraps the model in FSDP2 even on one
    rank, where there is nothing to shard and, with parameters already in the compute dtype, nothing
    to cast; it then only copies every parameter and gradient in and out of flat buffers each step
    (measured: ~20 % of a tiny-model CPU step). Checkpoints hold the same keys and values either way."""
    import functools

    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter, parallelize_qwen3
    from torchtitan.protocols.model_spec import ModelSpec

    return ModelSpec(
        name="qwen3",
        flavor=name,
        model=model_config(arch, attn_backend),
        parallelize_fn=parallelize_qwen3 if shard else functools.partial(parallelize_qwen3, skip_dp=True),
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=register_moe_load_balancing_hook if arch.is_moe else None,
        state_dict_adapter=Qwen3StateDictAdapter,
    )
