"""Helpers for tests that run the CLI and need a small checkpoint made in seconds (the session's
embedded models are conftest's `checkpoints` / `tiny_root` fixtures). (PYTEST_DONT_REWRITE: its
asserts carry their own messages.)"""

from __future__ import annotations

import subprocess
from pathlib import Path





def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The user-facing refusal: exit 2, no traceback, one `error: … Fix: …` line."""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Fix:" in lines[0], result.stderr
    return lines[0]


def small_random_checkpoint(directory: Path) -> Path:
    """A one-layer random Qwen3 written by transformers, with the real Qwen3 tokenizer: an HF
    directory every stage accepts, made in seconds (no pretraining, so its loss is ~ln(vocab))."""
    import shutil

    import torch
    import transformers

    from pipeline.checkpoint.embedded import TOKENIZER_FILES, tokenizer_dir

    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      tie_word_embeddings=True, dtype="float32")
    transformers.Qwen3ForCausalLM(config).save_pretrained(str(directory))
    for name in TOKENIZER_FILES:
        shutil.copy2(tokenizer_dir() / name, Path(directory) / name)
    return Path(directory)
