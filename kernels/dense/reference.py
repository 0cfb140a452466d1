"""The truth for `kernels.dense`: y = x @ w^T, XLA's dot (what `drama3_jax.nn.Linear` has always computed)."""

from __future__ import annotations

import jax


def linear_reference(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., K], w [N, K] (the checkpoint's [out, in]) -> [..., N] in out_dtype (default w.dtype). x is cast to
    w.dtype first; XLA accumulates bf16 products in fp32."""
    return jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=out_dtype)
