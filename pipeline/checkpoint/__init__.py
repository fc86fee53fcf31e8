"""Hugging Face checkpoint directories: the Qwen3 architecture they declare, their validation, the
embedded tiny models made offline, export manifests and the plain-transformers step-1 loss."""
