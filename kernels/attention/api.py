"""Public attention entry point; `backend` picks the implementation ("reference": plain jnp)."""

from __future__ import annotations

from kernels.attention.reference import attention_reference

BACKENDS = {"reference": attention_reference}


def attention(q, k, v, q_pos, kv_len, *, scale: float, backend: str = "reference"):
    """Causal GQA attention; see `reference.attention_reference` for shapes."""
    try:
        fn = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown attention backend {backend!r}; available: {sorted(BACKENDS)}") from None
    return fn(q, k, v, q_pos, kv_len, scale=scale)
