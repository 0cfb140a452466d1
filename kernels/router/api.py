"""Public MoE router entry point; `backend` picks the implementation.

Backends:
  "reference"      `lax.top_k` + a softmax over the k values (kernels/router/reference.py): two XLA kernels per layer.
  "pallas_triton"  one Pallas launch per layer (kernels/router/pallas_triton.py): k rounds of row max / lowest
                   argmax over a [rows, E] tile, then the softmax, same ids and (up to exp rounding) weights.
  "auto"           "pallas_triton" when JAX's default backend is a GPU, else "reference".
The model's `Backends.auto()` uses "auto" (timed on the H200: experiments/results/ab_2026-12-04/).
"""

from __future__ import annotations

from kernels.dispatch import pick_backend
from kernels.router.pallas_triton import router_topk_triton
from kernels.router.reference import router_topk_reference

BACKENDS = {"reference": router_topk_reference, "pallas_triton": router_topk_triton}


def router_topk(logits, k: int, *, num_experts: int | None = None, backend: str = "reference", **backend_kwargs):
    """logits [N, E] (any float dtype) -> (topk_ids [N, k] int32, topk_weights [N, k] fp32), largest first.
    num_experts: the router logits are the first num_experts columns of a wider `logits` (a fused projection's
    output, which the Pallas kernel reads in place instead of a slice copy)."""
    fn = pick_backend(BACKENDS, backend, "router", auto="pallas_triton")
    if num_experts is not None and not 1 <= num_experts <= logits.shape[-1]:
        raise ValueError(f"num_experts={num_experts} outside the logits' {logits.shape[-1]} columns")
    return fn(logits, k, num_experts=num_experts, **backend_kwargs)


__all__ = ["BACKENDS", "router_topk"]
