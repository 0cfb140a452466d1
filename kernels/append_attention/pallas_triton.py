"""Append decode attention as one Pallas GPU launch (Triton lowering): the decode attention kernel of
kernels/attention/pallas_triton.py with the layer's prologue folded in.

A decode step's attention layer was ~8 XLA kernels around the attention launch (q and k RMSNorms, their RoPE, the
two KV-cache scatters); at one stream the step is bound by its kernel count (1,152 kernels per step,
experiments/results/decode_2026-12-07_h100/). Here each program (sequence b, kv head h, split s) reads its query
group and the new k / v straight from the fused projection row, normalises and rotates them in registers, walks its
run of the cached keys (rows < position, flash-decoding splits as in the attention kernel) and adds the new key from
registers; split 0 also writes the new k / v into the caches (aliased in place), so no program reads a row being
written (rows at position >= the cache length are dropped, as the reference's scatter does). The splits merge in
plain jnp with the output gate (`combine_splits`).

RoPE in registers: element d of a head pairs with element `partner[d]` (d +- rotary/2 for rotate-half, d ^ 1 for
interleaved pairs), loaded a second time at the permuted columns and normalised with the same row statistic, so no
register shuffle is needed: out[d] = y[d] cos - y[partner[d]] sin (first of a pair) or + (second); cos / sin come
from the same fp32 table expression as `kernels.rope`. Numerics as the reference: norm in fp32 rounded to the
input dtype, rotation in fp32 rounded to it, scores and softmax in fp32; the new key's score adds in another order
than the tensor-core dot, and Triton's fp32 division is not IEEE-rounded, so values can differ by a rounding step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels.append_attention.layout import HeadLayout
from kernels.append_attention.reference import split_heads
from kernels.attention.pallas_triton import (MIN_ROWS, _next_pow2, _params, auto_splits, combine_splits,
                                             walk_split)
from kernels.rope import rope_inv_freq

f32 = jnp.float32


def _rope_pattern(D: int, rot: int, style: str):
    """Per element d of a head: partner column, sign of the partner's sin term (0 past the rotary dims), cos/sin
    table index, inside-rotary mask."""
    d = jax.lax.broadcasted_iota(jnp.int32, (D,), 0)
    inrot = d < rot
    if style == "rotate_half":
        half = rot // 2
        first = d < half
        partner = jnp.where(first, d + half, jnp.where(inrot, d - half, d))
        freq = jnp.where(first, d, jnp.where(inrot, d - half, 0))
    else:  # interleaved pairs (2i, 2i + 1)
        first = (d % 2) == 0
        partner = jnp.where(inrot, jnp.where(first, d + 1, d - 1), d)
        freq = jnp.where(inrot, d // 2, 0)
    sign = jnp.where(inrot, jnp.where(first, -1.0, 1.0), 0.0).astype(f32)
    return d, partner, sign, freq, inrot


def _kernel(len_ref, pos_ref, proj_ref, qw_ref, kw_ref, cos_ref, sin_ref, k_ref, v_ref,
            m_ref, l_ref, acc_ref, ko_ref, vo_ref, *, lay: HeadLayout, G, Gp, D, BK, NS, L, rot, style, scale, eps,
            zero_centered, prec):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dt = proj_ref.dtype
    pos = pos_ref[b]
    n = len_ref[b]                    # visible keys with the new one: min(kv_len, pos + 1), kv_len in [0, L]
    has_new = pos < n                 # the new row is visible (it appends at row pos)
    n_old = jnp.minimum(n, pos)       # visible keys already in the cache

    d, partner, sign, freq, inrot = _rope_pattern(D, rot, style)
    cos = plt.load(cos_ref.at[b, freq], mask=inrot, other=1.0)
    sin = plt.load(sin_ref.at[b, freq], mask=inrot, other=0.0)

    def norm_rope(cols, ok, w_ref):
        """The head vectors whose first columns are `cols` ([Gp, 1] or a scalar) -> normed, rotated, in dt."""
        x = plt.load(proj_ref.at[b, cols + d], mask=ok, other=0).astype(f32)
        xp = plt.load(proj_ref.at[b, cols + partner], mask=ok, other=0).astype(f32)
        inv = jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / D + eps)
        w, wp = plt.load(w_ref.at[d]).astype(f32), plt.load(w_ref.at[partner]).astype(f32)
        if zero_centered:
            w, wp = 1.0 + w, 1.0 + wp
        y = (x * inv * w).astype(dt).astype(f32)
        yp = (xp * inv * wp).astype(dt).astype(f32)
        return (y * cos + sign * yp * sin).astype(dt)

    g = jax.lax.broadcasted_iota(jnp.int32, (Gp, 1), 0)
    grp = g < G                                                     # real query rows of the padded group
    q = norm_rope((lay.q0 + (h * G + g) * lay.q_step) * D, jnp.broadcast_to(grp, (Gp, D)), qw_ref)   # [Gp, D]
    full = d >= 0
    k_new = norm_rope((lay.k0 + h) * D, full, kw_ref)                                                  # [D]
    v_new = plt.load(proj_ref.at[b, (lay.v0 + h) * D + d])

    write = (s == 0) & (pos < L)      # split 0 writes the new row (also where it is not visible: a free slot)
    first = (s == 0) & has_new        # and adds the new key to its softmax
    row = jnp.minimum(pos, L - 1)
    plt.store(ko_ref.at[b, row, h, :], k_new.astype(ko_ref.dtype), mask=full & write)
    plt.store(vo_ref.at[b, row, h, :], v_new.astype(vo_ref.dtype), mask=full & write)
    sc_new = jnp.sum(q.astype(f32) * k_new.astype(f32)[None, :], axis=1) * scale          # [Gp]
    took = first.astype(f32)
    m0 = jnp.where(jnp.broadcast_to(first, (Gp,)), sc_new, -jnp.inf)
    l0 = jnp.full((Gp,), 1.0, f32) * took
    acc0 = jnp.broadcast_to(v_new.astype(f32)[None, :], (Gp, D)) * took

    m, l, acc = walk_split(k_ref, v_ref, q, n_old, (m0, l0, acc0), b=b, h=h, s=s, BK=BK, NS=NS, scale=scale,
                           prec=prec)
    gi = g[:, 0]
    plt.store(m_ref.at[b, h, s, :], m, mask=gi < G)
    plt.store(l_ref.at[b, h, s, :], l, mask=gi < G)
    plt.store(acc_ref.at[b, h, s, :, :], acc, mask=jnp.broadcast_to(grp, (Gp, D)))


def append_decode_attention_triton(proj, q_norm, k_norm, k_cache, v_cache, start, new_lengths, *,
                                   layout: HeadLayout, rotary_dim: int, rope_theta: float, rope_style: str,
                                   eps: float, zero_centered: bool = True, block_k: int | None = None,
                                   num_splits: int | None = None, num_warps: int | None = None,
                                   num_stages: int | None = None, target_programs: int | None = None,
                                   max_splits: int | None = None, interpret: bool | None = None):
    """Same contract as `api.append_decode_attention`; tuning as kernels/attention's decode kernel (TUNING there).
    interpret=None runs the kernel on GPU and in Pallas interpret mode elsewhere."""
    p = _params(dict(block_k=block_k, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                     target_programs=target_programs, max_splits=max_splits))
    B = proj.shape[0]
    S, L, Hkv, D = k_cache.shape
    Hq = layout.num_q_heads
    G = Hq // Hkv
    Gp = max(MIN_ROWS, _next_pow2(G))
    if D != _next_pow2(D):
        raise ValueError(f"the Triton kernel wants a power-of-two head dim, got {D}")
    BK = p["block_k"]
    NS = p["num_splits"] or auto_splits(B, Hkv, L, BK, p["target_programs"], p["max_splits"])
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    start = start.astype(jnp.int32)
    n = jnp.minimum(jnp.clip(start + new_lengths.astype(jnp.int32), 0, L), start + 1)
    ang = start.astype(f32)[:, None] * rope_inv_freq(rotary_dim, rope_theta)        # [B, rotary / 2], as kernels.rope
    prec = jax.lax.Precision.HIGHEST if proj.dtype == f32 else None
    kern = functools.partial(_kernel, lay=layout, G=G, Gp=Gp, D=D, BK=BK, NS=NS, L=L, rot=rotary_dim,
                             style=rope_style, scale=float(D ** -0.5), eps=float(eps), zero_centered=zero_centered,
                             prec=prec)
    m, l, acc, k_cache, v_cache = pl.pallas_call(
        kern, grid=(B, Hkv, NS),
        out_shape=(jax.ShapeDtypeStruct((B, Hkv, NS, Gp), f32), jax.ShapeDtypeStruct((B, Hkv, NS, Gp), f32),
                   jax.ShapeDtypeStruct((B, Hkv, NS, Gp, D), f32), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        input_output_aliases={7: 3, 8: 4},
        compiler_params=plt.CompilerParams(num_warps=p["num_warps"], num_stages=p["num_stages"]),
        interpret=interpret, name="append_decode_attention",
    )(n, start, proj, q_norm, k_norm, jnp.cos(ang), jnp.sin(ang), k_cache, v_cache)
    o = combine_splits(m, l, acc, G).reshape(B, Hq, D).astype(proj.dtype)
    gate = split_heads(proj, layout)[1]
    o = o * jax.nn.sigmoid(gate.astype(f32)).astype(o.dtype)
    return o.reshape(B, Hq * D), k_cache, v_cache
