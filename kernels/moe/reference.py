"""Plain-jnp routed experts: every (token, k) pair gathers its expert's weights (dequantising only those).

x [T, H]; topk_ids [T, k] int32; topk_weights [T, k] (already renormalised); valid [T] bool or None (rows marked
False get 0); returns [T, H] in x.dtype.
y_t = sum_j w_tj * down_e(silu(gate_e x_t) * up_e x_t), e = topk_ids[t, j]; accumulation in fp32.
act_fp8 (W8A8, FP8 weights only): x and the bf16 SwiGLU output are quantised to e4m3 per (row, 128 columns) before
each GEMM (kernels/moe/quant.py), and the GEMMs run in fp32 on the dequantised values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.moe.quant import fake_quantize_groups_fp8
from kernels.moe.weights import ExpertWeights


def gathered_weight(w, scale, ids, block, dtype):
    """Weights of experts `ids` (any shape) as `dtype`, dequantised when FP8."""
    g = jnp.take(w, ids, axis=0)
    if scale is None:
        return g.astype(dtype)
    s = jnp.take(scale, ids, axis=0)
    out_dim, in_dim = w.shape[-2:]
    s = jnp.repeat(jnp.repeat(s, block[0], axis=-2), block[1], axis=-1)[..., :out_dim, :in_dim]
    return (g.astype(jnp.float32) * s).astype(dtype)


def moe_experts_reference(x, topk_ids, topk_weights, w: ExpertWeights, *, valid=None, act_fp8: bool = False,
                          x_fp8=None):
    """x_fp8 (W8A8): x's e4m3 groups (q [T, H], scale [T, H / 128]) made beforehand (kernels/norm), used as given."""
    if act_fp8 and not w.is_fp8:
        raise ValueError("act_fp8 (W8A8) needs FP8 expert weights")
    cdt = jnp.float32 if (x.dtype == jnp.float32 or act_fp8) else jnp.bfloat16
    if act_fp8 and x_fp8 is not None:
        q, s = x_fp8
        xg = (q.astype(jnp.float32).reshape(*s.shape, -1) * s[..., None]).reshape(x.shape)
    else:
        xg = fake_quantize_groups_fp8(x.astype(jnp.bfloat16)) if act_fp8 else x.astype(cdt)
    g = gathered_weight(w.gate, w.gate_scale, topk_ids, w.block, cdt)  # [T, k, I, H]
    u = gathered_weight(w.up, w.up_scale, topk_ids, w.block, cdt)
    d = gathered_weight(w.down, w.down_scale, topk_ids, w.block, cdt)  # [T, k, H, I]
    hg = jnp.einsum("th,tkih->tki", xg, g, preferred_element_type=jnp.float32)
    hu = jnp.einsum("th,tkih->tki", xg, u, preferred_element_type=jnp.float32)
    act = (jax.nn.silu(hg) * hu).astype(cdt)
    if act_fp8:  # the kernels store the SwiGLU output as bf16, then quantise it
        act = fake_quantize_groups_fp8(act.astype(jnp.bfloat16))
    y = jnp.einsum("tki,tkhi->tkh", act, d, preferred_element_type=jnp.float32)
    y = jnp.sum(y * topk_weights.astype(jnp.float32)[..., None], axis=1)
    if valid is not None:
        y = jnp.where(valid[:, None], y, 0)
    return y.astype(x.dtype)
