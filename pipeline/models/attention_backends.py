"""The attention backends a config may choose (`attention_backend`), without importing torch: what
torchtitan's Qwen3 is built with and which override replaces its kernel (see models/attention.py)."""

from __future__ import annotations

DOCUMENT_SDPA = "pipeline.models.attention.document_sdpa"

# attention_backend -> (torchtitan attn_backend, override.imports entry or None)
BACKENDS = {
    "flex": ("flex", None),
    "document_sdpa": ("varlen", DOCUMENT_SDPA),
}


def titan_backend(attention_backend: str) -> str:
    return BACKENDS[attention_backend][0]


def override_for(attention_backend: str) -> str | None:
    return BACKENDS[attention_backend][1]
