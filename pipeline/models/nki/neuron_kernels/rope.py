"""RoPE: nki-library's `rope_hf` (core/embeddings/rope_hf.py), already `@nki.jit`: handed to wrap_nki as
it is, with no jit of ours around it."""

from __future__ import annotations

from nkilib.core.embeddings.rope_hf import rope_hf

__all__ = ["rope_hf"]
