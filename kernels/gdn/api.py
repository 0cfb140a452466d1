"""Public Gated DeltaNet entry points; `backend` picks the implementation.

Backends: "reference" (plain jnp, the truth; `gdn_prefill` uses the chunked form, "reference_recurrent" the
token-by-token scan). Pallas GPU backends register here when they exist.
"""

from __future__ import annotations

from kernels.gdn import reference

PREFILL_BACKENDS = {
    "reference": reference.gated_delta_chunked,
    "reference_recurrent": reference.gated_delta_recurrent,
}
DECODE_BACKENDS = {
    "reference": reference.gdn_decode_step,
}


def gdn_prefill(q, k, v, g, beta, initial_state=None, lengths=None, *, backend: str = "reference"):
    """Gated delta rule over a batch of (right-padded) sequences.

    q, k [B, T, H_k, D_k]; v [B, T, H_v, D_v]; g (log decay), beta [B, T, H_v]; initial_state [B, H_v, D_k, D_v];
    lengths [B] int32 (None: all T). L2 norm of q/k and the D_k^-1/2 query scale happen inside.
    Returns (o [B, T, H_v, D_v] fp32, final_state [B, H_v, D_k, D_v] fp32)."""
    return _pick(PREFILL_BACKENDS, backend)(q, k, v, g, beta, initial_state, lengths)


def gdn_decode_step(mixed_qkv, a, b, conv_state, ssm_state, conv_weight, A_log, dt_bias, *, num_k_heads: int,
                    head_k_dim: int, head_v_dim: int, slots=None, backend: str = "reference"):
    """Fused single-token GDN step on slot pools; see `reference.gdn_decode_step` for shapes."""
    return _pick(DECODE_BACKENDS, backend)(mixed_qkv, a, b, conv_state, ssm_state, conv_weight, A_log, dt_bias,
                                           num_k_heads=num_k_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
                                           slots=slots)


def _pick(table, backend):
    try:
        return table[backend]
    except KeyError:
        raise ValueError(f"unknown GDN backend {backend!r}; available: {sorted(table)}") from None
