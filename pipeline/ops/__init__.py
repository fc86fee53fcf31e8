"""PyTorch reference implementations of the operators the NKI path replaces."""

from pipeline.ops.reference import experts_reference

__all__ = ["experts_reference"]
