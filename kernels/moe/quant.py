"""Dynamic FP8 quantisation of activations, per row and group of 128 columns (the W8A8 path of the MoE backends).

x ~= q * s with q e4m3 and one fp32 scale s = amax / 448 per (row, group): the activation layout of DeepSeek-V3's
fine-grained FP8 recipe, which block-FP8 checkpoints such as Qwen3's are made for, and what vLLM's block-FP8 fused_moe
runs by default (per-token-group quantisation, group 128). The same function quantises a [rows, 128] tile inside the
Pallas kernels and whole arrays in the reference, so both round identically.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_MAX = 448.0  # largest finite float8_e4m3fn
ACT_GROUP = 128  # columns per activation scale (one weight scale block along K)


def quantize_rows_fp8(x):
    """x [..., G] (one group per row) -> (q [..., G] float8_e4m3fn, scale [...] fp32); x ~= q * scale[..., None]."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (xf / scale[..., None]).astype(jnp.float8_e4m3fn), scale


def quantize_groups_fp8(x, group: int = ACT_GROUP):
    """x [..., K] (K a multiple of `group`) -> (q [..., K] float8_e4m3fn, scale [..., K / group] fp32): each (row,
    group) quantised on its own."""
    *lead, K = x.shape
    if K % group:
        raise ValueError(f"activation width {K} is not a multiple of the FP8 group {group}")
    q, s = quantize_rows_fp8(x.reshape(*lead, K // group, group))
    return q.reshape(*lead, K), s


def fake_quantize_groups_fp8(x, group: int = ACT_GROUP):
    """x [..., K] (K a multiple of `group`) -> fp32 [..., K]: each (row, group) quantised to e4m3 and scaled back."""
    *lead, K = x.shape
    q, s = quantize_groups_fp8(x, group)
    q = q.reshape(*lead, K // group, group)
    # the barrier keeps XLA from folding the f32 -> e4m3 -> f32 round trip away: on the H200 the reference without it
    # was 4.4% away from the kernel and from itself with bf16 activations alike, i.e. it had not quantised at all
    # (experiments/results/moe_w8a8_2026-12-01)
    q = jax.lax.optimization_barrier(q)
    return (q.astype(jnp.float32) * s[..., None]).reshape(*lead, K)
