"""RMSNorm and the fused residual add + RMSNorm (+ FP8 groups) in plain jnp: the truth for `kernels/norm`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.moe.quant import quantize_groups_fp8


def rms_norm(x, weight, eps: float, *, zero_centered: bool = True, out_dtype=None):
    """RMSNorm over the last axis in fp32: x / sqrt(mean(x^2) + eps) * (1 + w) (zero_centered, Qwen3.5 / tower) or
    * w; rounded to out_dtype (x.dtype when None)."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    y = y * (1.0 + w if zero_centered else w)
    return y.astype(out_dtype or x.dtype)


def add_rms_norm_reference(x, residual, weight, *, eps: float, zero_centered: bool = True,
                           quant_group: int | None = None):
    """s = x + residual (in x.dtype, as the model's residual stream), y = rms_norm(s) in x.dtype; with quant_group,
    also y as e4m3 groups (q [N, H] float8_e4m3fn, scale [N, H / group] fp32: kernels.moe.quant). x, residual
    [N, H]; weight [H]. Returns (s, y) or (s, y, q, scale)."""
    s = (x + residual).astype(x.dtype)
    y = rms_norm(s, weight, eps, zero_centered=zero_centered)
    if quant_group is None:
        return s, y
    return (s, y, *quantize_groups_fp8(y, quant_group))
