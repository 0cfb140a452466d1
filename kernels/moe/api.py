"""Public MoE entry point; `backend` picks the implementation.

Backends:
  "reference"          plain jnp gather (the truth; gathers every (token, slot)'s expert weights: small T only).
  "xla_ragged_dot"     sort + `lax.ragged_dot` (the XLA baseline).
  "pallas_triton"      Pallas grouped GEMMs, Triton lowering (kernels/moe/pallas_triton.py): in-kernel token gather,
                       gate+up with fused SwiGLU, down with the router weight in the epilogue; FP8 W8A16 or bf16.
  "pallas"             the default Pallas GPU backend (currently "pallas_triton", the one measured fastest on the H200).

Every backend takes the checkpoint-layout `ExpertWeights` as is: FP8 e4m3 + fp32 128x128 block scales, or bf16, in the
[out, in] orientation. No load-time re-layout is needed; the Pallas kernels index the checkpoint layout directly. Backend-specific
keyword options pass through `**options` (e.g. `interpret=True` to run a Pallas backend in interpret mode on CPU,
`config=` to override the block-size table).
"""

from __future__ import annotations

from kernels.dispatch import pick_backend
from kernels.moe.pallas_triton import moe_experts_pallas_triton
from kernels.moe.reference import moe_experts_reference
from kernels.moe.weights import ExpertWeights
from kernels.moe.xla_ragged_dot import moe_experts_ragged_dot

BACKENDS = {
    "reference": moe_experts_reference,
    "xla_ragged_dot": moe_experts_ragged_dot,
    "pallas_triton": moe_experts_pallas_triton,
}
BACKENDS["pallas"] = BACKENDS["pallas_triton"]


def moe_experts(x, topk_ids, topk_weights, weights: ExpertWeights, *, backend: str = "reference", valid=None,
                **options):
    """Routed-expert output of one layer. x [T, H]; topk_ids/topk_weights [T, k]; returns [T, H] in x.dtype.
    valid [T] bool (None: every row): rows marked False (padding) get 0, and a backend may skip their work (the
    Pallas one does)."""
    fn = pick_backend(BACKENDS, backend, "MoE", auto="pallas_triton")
    return fn(x, topk_ids, topk_weights, weights, valid=valid, **options)


__all__ = ["ExpertWeights", "moe_experts", "BACKENDS"]
