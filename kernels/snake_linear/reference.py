"""The codec residual unit's tail in plain jnp: the truth for `kernels/snake_linear`, and exactly what
`drama3_jax.codec.layers.ResidualUnit` computed before the op existed (same ops, same roundings)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def snake(h, alpha):
    """Snake h + 1/(alpha + 1e-9) sin^2(alpha h) with per-channel alpha [C] over the last axis; fp32 math, result in
    h.dtype (fish-speech / descript-audio-codec `snake`)."""
    a = alpha.astype(jnp.float32)
    hf = h.astype(jnp.float32)
    return (hf + (1.0 / (a + 1e-9)) * jnp.sin(a * hf) ** 2).astype(h.dtype)


def snake_linear_residual_reference(h, alpha, w, b, x):
    """x + (snake(h) @ w + b). h [M, K], alpha [K], w [K, N], b [N], x [M, N] -> [M, N] in x.dtype. The product
    takes w's dtype in and gives it out (fp32 accumulation inside the dot), the bias adds in that dtype, the result is
    cast to x.dtype and added to x."""
    y = jax.lax.dot_general(snake(h, alpha).astype(w.dtype), w, (((1,), (0,)), ((), ())))
    return x + (y + b).astype(x.dtype)
