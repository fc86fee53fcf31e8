"""torchtitan's own Qwen3, built with the shapes of a checkpoint's config.json.

torchtitan only ships named flavors; its builders for a flavor's layers are private
(`_build_qwen3_layers` and friends in torchtitan.models.qwen3, 0.3.0). We call them with
the checkpoint's numbers so the layer/parameter-init conventions stay torchtitan's own.
"""

from __future__ import annotations

from pipeline.qwen3_arch import TITAN_RMS_NORM_EPS, Qwen3Arch


def model_config(arch: Qwen3Arch, attn_backend: str = "flex"):
    from torchtitan.models import qwen3 as titan_qwen3
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    rope = CosSinRoPE.Config(dim=arch.head_dim, max_seq_len=arch.max_position_embeddings, theta=arch.rope_theta)
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
        layers = titan_qwen3._build_qwen3_moe_layers(
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
        layers = titan_qwen3._build_qwen3_layers(**common, hidden_dim=arch.intermediate_size)
    assert titan_qwen3._EPS == TITAN_RMS_NORM_EPS
    return titan_qwen3.Qwen3Model.Config(
        vocab_size=arch.vocab_size,
        dim=arch.hidden_size,
        norm=titan_qwen3._qwen3_norm(arch.hidden_size),
        enable_weight_tying=arch.tie_word_embeddings,
        tok_embeddings=Embedding.Config(
            num_embeddings=arch.vocab_size,
            embedding_dim=arch.hidden_size,
            param_init=titan_qwen3._EMBEDDING_SKIP_INIT if arch.tie_word_embeddings else titan_qwen3._EMBEDDING_INIT,
        ),
        lm_head=Linear.Config(in_features=arch.hidden_size, out_features=arch.vocab_size,
                              param_init=titan_qwen3._LINEAR_INIT),
        layers=layers,
    )


def model_spec(arch: Qwen3Arch, name: str):
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter, parallelize_qwen3
    from torchtitan.protocols.model_spec import ModelSpec

    return ModelSpec(
        name="qwen3",
        flavor=name,
        model=model_config(arch),
        parallelize_fn=parallelize_qwen3,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=register_moe_load_balancing_hook if arch.is_moe else None,
        state_dict_adapter=Qwen3StateDictAdapter,
    )


def flavor_arch(flavor: str, like: Qwen3Arch) -> Qwen3Arch:
    """What torchtitan's named flavor claims, in the same terms as a config.json."""
    from torchtitan.models.qwen3 import qwen3_configs

    if flavor not in qwen3_configs:
        from pipeline.errors import PipelineError

        raise PipelineError(f"torchtitan has no Qwen3 flavor {flavor!r}.", f"use one of {sorted(qwen3_configs)} or none.")
    cfg = qwen3_configs[flavor](attn_backend="flex")
    first = cfg.layers[0]
    attn = first.attention
    rope = attn.rope
    moe = getattr(first, "moe", None)
    return Qwen3Arch(
        model_type=like.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=first.feed_forward.w1.out_features if getattr(first, "feed_forward", None) else like.intermediate_size,
        num_hidden_layers=len(cfg.layers),
        num_attention_heads=attn.wo.in_features // attn.head_dim,
        num_key_value_heads=attn.n_kv_heads,
        head_dim=attn.head_dim,
        rope_theta=rope.theta,
        max_position_embeddings=rope.max_seq_len,
        tie_word_embeddings=cfg.enable_weight_tying,
        rms_norm_eps=like.rms_norm_eps,
        num_experts=moe.num_experts if moe else 0,
        num_experts_per_tok=moe.router.top_k if moe else 0,
        moe_intermediate_size=moe.routed_experts.inner_experts.hidden_dim if moe else 0,
    )
