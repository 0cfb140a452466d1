"""Public attention entry point; `backend` picks the implementation ("reference": plain jnp)."""

from __future__ import annotations

from kernels.attention.reference import attention_reference
from kernels.dispatch import pick_backend

BACKENDS = {"reference": attention_reference}


def attention(q, k, v, q_pos, kv_len, *, scale: float, backend: str = "reference"):
    """Causal GQA attention; see `reference.attention_reference` for shapes."""
    return pick_backend(BACKENDS, backend, "attention")(q, k, v, q_pos, kv_len, scale=scale)
