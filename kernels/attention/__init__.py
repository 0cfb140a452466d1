"""Causal GQA attention over a per-slot KV cache."""
from kernels.attention.api import attention

__all__ = ["attention"]
