"""Public Gated DeltaNet entry points; `backend` picks the implementation.

Backends:
  "reference"            plain jnp, the truth (`gdn_prefill`: chunked WY form; decode: conv + recurrence step).
  "reference_recurrent"  prefill only: the token-by-token scan.
  "pallas_triton"        Pallas GPU kernels, Triton lowering (kernels/gdn/pallas_triton.py): chunked prefill
                         (three launches; packed sequences read in place) and the single-step decode on the
                         slot pools, both updated in place (a prep launch per key head: conv, norms, gates, conv
                         shift; then a streaming launch per state tile).
  "auto"                 "pallas_triton" when JAX's default backend is a GPU, else "reference".

Extra keyword arguments (`**backend_kwargs`) go to the chosen implementation, e.g. `interpret=True` (Pallas
interpret mode, for CPU tests) or tuning overrides (`bv=`, `num_warps=`, `dot=` ...; see pallas_triton.TUNING).
For the decode step, donate the conv/ssm pools at the enclosing `jax.jit` so the Pallas kernel updates them in
place (no copy of the pool per step).
"""

from __future__ import annotations

import functools

from kernels.dispatch import pick_backend
from kernels.gdn import pallas_triton, reference

PREFILL_BACKENDS = {
    "reference": reference.gated_delta_chunked,
    "reference_recurrent": reference.gated_delta_recurrent,
    "pallas_triton": pallas_triton.gated_delta_chunk_prefill_triton,
}
PACKED_PREFILL_BACKENDS = {
    "reference": functools.partial(reference.gated_delta_packed, reference.gated_delta_chunked),
    "reference_recurrent": functools.partial(reference.gated_delta_packed, reference.gated_delta_recurrent),
    "pallas_triton": pallas_triton.gated_delta_packed_prefill_triton,
}
DECODE_BACKENDS = {
    "reference": reference.gdn_decode_step,
    "pallas_triton": pallas_triton.gdn_decode_step_triton,
}


def gdn_prefill(q, k, v, g, beta, initial_state=None, lengths=None, *, offsets=None, seq_len: int | None = None,
                backend: str = "reference", **backend_kwargs):
    """Gated delta rule over a batch of (right-padded) sequences, or of sequences packed end to end.

    q, k [B, T, H_k, D_k]; v [B, T, H_v, D_v]; g (log decay), beta [B, T, H_v]; initial_state [B, H_v, D_k, D_v];
    lengths [B] int32 (None: all T). L2 norm of q/k and the D_k^-1/2 query scale happen inside.
    Returns (o [B, T, H_v, D_v] fp32, zero past each length; final_state [B, H_v, D_k, D_v] fp32).
    Packed (`offsets` [P] given): q ... beta are [1, N, ...] rows, sequence p at rows offsets[p] .. offsets[p] +
    lengths[p] - 1, every length <= `seq_len` (static); initial_state / final_state [P, ...]; o [1, N, H_v, D_v],
    zero outside every sequence."""
    if offsets is not None:
        fn = pick_backend(PACKED_PREFILL_BACKENDS, backend, "GDN", auto="pallas_triton")
        return fn(q, k, v, g, beta, initial_state, offsets, lengths, seq_len=seq_len, **backend_kwargs)
    fn = pick_backend(PREFILL_BACKENDS, backend, "GDN", auto="pallas_triton")
    return fn(q, k, v, g, beta, initial_state, lengths, **backend_kwargs)


def gdn_decode_step(mixed_qkv, a, b, conv_state, ssm_state, conv_weight, A_log, dt_bias, *, num_k_heads: int,
                    head_k_dim: int, head_v_dim: int, slots=None, v_major: bool = False,
                    a_col: int | None = None, b_col: int | None = None, backend: str = "reference",
                    **backend_kwargs):
    """Fused single-token GDN step on slot pools; see `reference.gdn_decode_step` for shapes. v_major: the pool holds
    each head's state transposed, [S, H_v, D_v, D_k] (the model's layout: the Pallas kernel's D_k reductions then run
    along the contiguous axis). a_col / b_col (with a, b None): mixed_qkv is the layer's whole fused in-projection
    output and a, b are read from those columns; the Pallas kernels read the three inputs in place (three slice
    copies fewer per layer)."""
    if (a_col is None) != (b_col is None) or (a_col is None) != (a is not None and b is not None):
        raise ValueError("give either a and b, or a_col and b_col (with a, b None)")
    fn = pick_backend(DECODE_BACKENDS, backend, "GDN", auto="pallas_triton")
    return fn(mixed_qkv, a, b, conv_state, ssm_state, conv_weight, A_log, dt_bias, num_k_heads=num_k_heads,
              head_k_dim=head_k_dim, head_v_dim=head_v_dim, slots=slots, v_major=v_major, a_col=a_col, b_col=b_col,
              **backend_kwargs)
