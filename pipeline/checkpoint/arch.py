"""Qwen3's architecture as read from a checkpoint's config.json — the one source of shapes.

Every training path builds its model from this, never from a named torchtitan flavor: the
built-in `4B` flavor, for example, says rope_theta 1e6 while Qwen3-4B-Instruct-2507 has 5e6.
Pure Python (no torch), so dry runs and config checks work on any machine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.errors import PipelineError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")
# Bounds far above any Qwen3 release (largest: 94 layers, 128 experts, hidden 4096, vocab 151936,
# 262144 positions), checked before anything is sized from config.json: a config claiming 10⁸ layers
# would otherwise build a 10⁹-entry table of expected tensors (download) or a terabyte estimate.
LIMITS = {"vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 20, "num_hidden_layers": 1024,
          "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 4096,
          "max_position_embeddings": 1 << 24, "num_experts": 4096, "num_experts_per_tok": 4096,
          "moe_intermediate_size": 1 << 20}
# torchtitan's Qwen3 hard-codes these; a checkpoint that differs cannot be trained faithfully.
TITAN_RMS_NORM_EPS = 1e-6


@dataclass(frozen=True)
class Qwen3Arch:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rms_norm_eps: float
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def to_dict(self) -> dict:
        return asdict(self)

    # ---- parameter and FLOP counts: the one place every training path takes them from ----------

    def layer_params(self) -> dict[str, int]:
        """Parameters of one decoder layer, by part (Hugging Face's modules, any training path)."""
        h, hd = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        parts = {"attention": h * (q + 2 * kv) + q * h, "norms": 2 * h + 2 * hd}
        if self.is_moe:
            parts |= {"router": self.num_experts * h, "experts": self.num_experts * 3 * h * self.moe_intermediate_size}
        else:
            parts |= {"mlp": 3 * h * self.intermediate_size}
        return parts

    def param_counts(self) -> dict[str, int]:
        """Every parameter, by part; a tied lm_head is the embedding and counts once."""
        layer = self.layer_params()
        counts = {key: value * self.num_hidden_layers for key, value in layer.items()}
        counts |= {"embedding": self.vocab_size * self.hidden_size, "final_norm": self.hidden_size,
                   "lm_head": 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size}
        return counts

    @property
    def num_params(self) -> int:
        return sum(self.param_counts().values())

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token, with torchtitan's convention (models/utils.py,
        get_moe_model_nparams_and_flops): 6 per parameter a token passes through a matmul of — the
        embedding lookup is no matmul, the lm_head is one whether or not it is tied — with only
        top_k/num_experts of the routed experts active, plus 6·layers·heads·(2·head_dim)·seq_len for
        the attention scores and values. MFU must not depend on which path implements the model."""
        counts = self.param_counts()
        active = sum(counts.values()) - counts["embedding"] - counts["lm_head"]
        active += self.vocab_size * self.hidden_size  # the lm_head matmul, tied or not
        if self.is_moe:
            active -= counts["experts"] - counts["experts"] * self.num_experts_per_tok // self.num_experts
        attention = 6 * self.num_hidden_layers * self.num_attention_heads * (2 * self.head_dim) * seq_len
        return 6 * active + attention

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face key → shape, as the Hub stores it (per-expert keys for MoE)."""
        h, hd = self.hidden_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h),
            "model.norm.weight": (h,),
        }
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "self_attn.q_proj.weight": (self.num_attention_heads * hd, h),
                p + "self_attn.k_proj.weight": (self.num_key_value_heads * hd, h),
                p + "self_attn.v_proj.weight": (self.num_key_value_heads * hd, h),
                p + "self_attn.o_proj.weight": (h, self.num_attention_heads * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
            if self.is_moe:
                shapes[p + "mlp.gate.weight"] = (self.num_experts, h)
                m = self.moe_intermediate_size
                for e in range(self.num_experts):
                    q = f"{p}mlp.experts.{e}."
                    shapes |= {
                        q + "gate_proj.weight": (m, h),
                        q + "up_proj.weight": (m, h),
                        q + "down_proj.weight": (h, m),
                    }
            else:
                f = self.intermediate_size
                shapes |= {
                    p + "mlp.gate_proj.weight": (f, h),
                    p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f),
                }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


def _rope_theta(cfg: dict, where: str) -> float:
    # transformers 4.51 wrote a top-level rope_theta; transformers 5 writes rope_parameters.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise PipelineError(
            f"{where}: rope_type {kind!r} is not supported (torchtitan's Qwen3 uses plain RoPE).",
            "use a Qwen3 checkpoint without rope scaling.",
        )
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise PipelineError(f"{where}: neither rope_parameters.rope_theta nor rope_theta is set.",
                            "add the checkpoint's rope_theta to config.json.")
    return float(theta)


def arch_from_config(cfg: dict, where: str = "config.json") -> Qwen3Arch:
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise PipelineError(
            f"{where}: model_type is {model_type!r}; this pipeline trains {', '.join(SUPPORTED_MODEL_TYPES)}.",
            "point MODEL at a Qwen3 or Qwen3-MoE checkpoint.",
        )
    required = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"]
    missing = [k for k in required if k not in cfg]
    if missing:
        raise PipelineError(f"{where}: missing keys {missing}.", "use the checkpoint's original config.json.")
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg["num_key_value_heads"])
    if heads % kv_heads:
        raise PipelineError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}.",
                            "fix config.json.")
    eps = float(cfg.get("rms_norm_eps", TITAN_RMS_NORM_EPS))
    if eps != TITAN_RMS_NORM_EPS:
        raise PipelineError(f"{where}: rms_norm_eps is {eps}; torchtitan's Qwen3 is built with {TITAN_RMS_NORM_EPS}.",
                            "train a checkpoint with rms_norm_eps 1e-6 (all Qwen3 releases).")
    if cfg.get("attention_bias"):
        raise PipelineError(f"{where}: attention_bias is true; Qwen3 has no attention bias.", "fix config.json.")
    if cfg.get("use_sliding_window"):
        raise PipelineError(f"{where}: use_sliding_window is true; not supported.", "set it to false.")
    fields = dict(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg.get("intermediate_size", 0)),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rope_theta=_rope_theta(cfg, where),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 40960)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=eps,
    )
    if model_type == "qwen3_moe":
        # Hub configs (transformers 4.51) say num_experts; transformers 5 writes num_local_experts.
        if "num_experts" not in cfg and "num_local_experts" in cfg:
            cfg = {**cfg, "num_experts": cfg["num_local_experts"]}
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if key not in cfg:
                raise PipelineError(f"{where}: MoE config lacks {key}.", "use the checkpoint's original config.json.")
        if not cfg.get("norm_topk_prob", False):
            raise PipelineError(f"{where}: norm_topk_prob is false; torchtitan's Qwen3-MoE router always normalises top-k.",
                                "train a checkpoint with norm_topk_prob true (Qwen3-30B-A3B, 235B-A22B).")
        if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
            raise PipelineError(f"{where}: mixes dense and MoE layers (decoder_sparse_step/mlp_only_layers).",
                                "use a checkpoint whose every layer is MoE, as all Qwen3-MoE releases are.")
        fields |= dict(
            num_experts=int(cfg["num_experts"]),
            num_experts_per_tok=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        )
    _check_limits(fields, where)
    return Qwen3Arch(**fields)


def _check_limits(fields: dict, where: str) -> None:
    for key, limit in LIMITS.items():
        value = fields.get(key)
        if value is None or (value == 0 and key in ("intermediate_size", "num_experts", "num_experts_per_tok",
                                                    "moe_intermediate_size")):
            continue  # 0: the part is absent (no dense MLP in an MoE, no experts in a dense model)
        if not 1 <= value <= limit:
            raise PipelineError(f"{where}: {key} is {value}, outside 1…{limit} (beyond any Qwen3).",
                                "use the checkpoint's original config.json.")
    if fields.get("num_experts_per_tok", 0) > fields.get("num_experts", 0):
        raise PipelineError(f"{where}: num_experts_per_tok {fields['num_experts_per_tok']} is more than num_experts "
                            f"{fields['num_experts']}: the router cannot pick that many experts.",
                            "use the checkpoint's original config.json (num_experts_per_tok ≤ num_experts).")


def load_arch(hf_dir: Path, fix: str = "give a Hugging Face checkpoint directory with its config.json.") -> Qwen3Arch:
    """`fix` says what the caller's user does about a missing or unreadable config.json (download:
    point MODEL elsewhere; a run: download again)."""
    from pipeline.fsutil import read_small_text

    path = Path(hf_dir) / "config.json"
    try:
        cfg = json.loads(read_small_text(path, fix=fix))
    except FileNotFoundError as err:
        raise PipelineError(f"{path} does not exist.", fix) from err
    except json.JSONDecodeError as err:
        raise PipelineError(f"{path} is not valid JSON ({err}).", fix) from err
    if not isinstance(cfg, dict):
        raise PipelineError(f"{path} is not a JSON object.", fix)
    return arch_from_config(cfg, str(path))
