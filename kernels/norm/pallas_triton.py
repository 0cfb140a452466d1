"""Residual add + RMSNorm (+ FP8 groups) as one Pallas GPU launch (Triton lowering).

Each layer of the backbone adds its token mixer's output to the residual stream and normalises the sum for the MoE,
whose W8A8 experts then want that input as e4m3 groups of 128 columns with one fp32 scale each. In XLA that is about
four kernels per layer (the add with the sum of squares, the scaling, the group maxima, the e4m3 conversion): at one
stream the decode step is bound by its kernel count (~1,360 kernels of ~3.3 us of work and ~2.3 us of gap each,
experiments/results/profiles_2026-12-04/decode_1slot/). Here one program per row holds the row as a [groups, 128]
tile in registers and writes the sum, the normalised row and, when asked, the e4m3 row and its group scales.

Numerics follow `reference.add_rms_norm_reference`: the sum rounded to the input dtype, the norm in fp32 on that
rounded sum, the output rounded to the input dtype, the groups quantised from that rounded output
(`kernels.moe.quant.quantize_rows_fp8`, the function the MoE kernels use in registers too). The sum of squares adds
in another order than XLA's, and Triton's fp32 division is not IEEE-rounded: an element can land one rounding step
away from the reference (bf16 / e4m3), which the tests bound.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels.moe.quant import quantize_rows_fp8

f32 = jnp.float32

# warps per program (one row of H = 2,048 as a [16, 128] tile: 16 values per thread at 4 warps). Not yet timed on the
# H200 apart from the decode step it sits in (experiments/decode_profile.py, variant ..._xla_norm for the A/B).
TUNING = {"num_warps": 4}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _add_rms_norm_kernel(x_ref, r_ref, w_ref, s_ref, y_ref, *quant_refs, H, R, C, eps, zero_centered):
    row = pl.program_id(0)
    g = jax.lax.broadcasted_iota(jnp.int32, (R, C), 0)
    idx = g * C + jax.lax.broadcasted_iota(jnp.int32, (R, C), 1)
    ok = idx < H
    x = plt.load(x_ref.at[row, idx], mask=ok, other=0.0)
    r = plt.load(r_ref.at[row, idx], mask=ok, other=0.0)
    s = (x.astype(f32) + r.astype(f32)).astype(x.dtype)
    plt.store(s_ref.at[row, idx], s, mask=ok)
    sf = s.astype(f32)
    inv = jax.lax.rsqrt(jnp.sum(sf * sf) / H + eps)
    w = plt.load(w_ref.at[idx], mask=ok, other=0.0).astype(f32)
    y = (sf * inv * (1.0 + w if zero_centered else w)).astype(x.dtype)
    plt.store(y_ref.at[row, idx], y, mask=ok)
    if quant_refs:
        q_ref, scale_ref = quant_refs
        q, scale = quantize_rows_fp8(jnp.where(ok, y, 0.0))        # [R, C] e4m3, [R] fp32
        plt.store(q_ref.at[row, idx], q, mask=ok)
        gi = jax.lax.broadcasted_iota(jnp.int32, (R,), 0)
        plt.store(scale_ref.at[row, gi], scale, mask=gi < H // C)


def add_rms_norm_triton(x, residual, weight, *, eps: float, zero_centered: bool = True,
                        quant_group: int | None = None, num_warps: int | None = None, interpret: bool | None = None):
    """Same contract as `reference.add_rms_norm_reference`; one program per row. interpret=None runs the kernel on
    GPU and in Pallas interpret mode elsewhere."""
    N, H = x.shape
    C = quant_group or min(128, _pow2(H))
    if C & (C - 1):
        raise ValueError(f"the FP8 group must be a power of two for the Triton tile, got {C}")
    R = _pow2(-(-H // C))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    out_shape = [jax.ShapeDtypeStruct((N, H), x.dtype), jax.ShapeDtypeStruct((N, H), x.dtype)]
    if quant_group:
        out_shape += [jax.ShapeDtypeStruct((N, H), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((N, H // C), f32)]
    return tuple(pl.pallas_call(
        functools.partial(_add_rms_norm_kernel, H=H, R=R, C=C, eps=eps, zero_centered=zero_centered),
        grid=(N,),
        out_shape=tuple(out_shape),
        compiler_params=plt.CompilerParams(num_warps=num_warps or TUNING["num_warps"], num_stages=1),
        interpret=interpret, name="add_rms_norm",
    )(x, residual, weight))
