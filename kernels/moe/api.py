"""Public MoE entry point; `backend` picks the implementation.

Backends: "reference" (plain jnp gather, the truth), "xla_ragged_dot" (sort + `lax.ragged_dot`, the XLA
baseline). Pallas GPU backends register here when they exist.
"""

from __future__ import annotations

from kernels.moe.reference import moe_experts_reference
from kernels.moe.weights import ExpertWeights
from kernels.moe.xla_ragged_dot import moe_experts_ragged_dot

BACKENDS = {
    "reference": moe_experts_reference,
    "xla_ragged_dot": moe_experts_ragged_dot,
}


def moe_experts(x, topk_ids, topk_weights, weights: ExpertWeights, *, backend: str = "reference"):
    """Routed-expert output of one layer. x [T, H]; topk_ids/topk_weights [T, k]; returns [T, H] in x.dtype."""
    try:
        fn = BACKENDS[backend]
    except KeyError:
        raise ValueError(f"unknown MoE backend {backend!r}; available: {sorted(BACKENDS)}") from None
    return fn(x, topk_ids, topk_weights, weights)


__all__ = ["ExpertWeights", "moe_experts", "BACKENDS"]
