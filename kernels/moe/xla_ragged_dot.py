"""Baseline: sort (token, k) pairs by expert, `jax.lax.ragged_dot` per projection, weighted scatter-add back.
FP8 weights are dequantised whole (every expert) before the GEMMs, as plain XLA would do."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.moe.weights import ExpertWeights
from kernels.moe.reference import gathered_weight


def moe_experts_ragged_dot(x, topk_ids, topk_weights, w: ExpertWeights, *, valid=None):
    T, H = x.shape
    k = topk_ids.shape[1]
    E = w.num_experts
    cdt = jnp.float32 if x.dtype == jnp.float32 else jnp.bfloat16
    flat = topk_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    xs = x.astype(cdt)[token]  # [T*k, H]
    all_ids = jnp.arange(E)
    to_in_out = lambda a: jnp.swapaxes(a, 1, 2)  # [E, out, in] -> [E, in, out]
    g = to_in_out(gathered_weight(w.gate, w.gate_scale, all_ids, w.block, cdt))
    u = to_in_out(gathered_weight(w.up, w.up_scale, all_ids, w.block, cdt))
    d = to_in_out(gathered_weight(w.down, w.down_scale, all_ids, w.block, cdt))
    hg = jax.lax.ragged_dot(xs, g, group_sizes, preferred_element_type=jnp.float32)
    hu = jax.lax.ragged_dot(xs, u, group_sizes, preferred_element_type=jnp.float32)
    act = (jax.nn.silu(hg) * hu).astype(cdt)
    y = jax.lax.ragged_dot(act, d, group_sizes, preferred_element_type=jnp.float32)
    y = y * topk_weights.reshape(-1)[order].astype(jnp.float32)[:, None]
    out = jnp.zeros((T, H), jnp.float32).at[token].add(y)
    if valid is not None:
        out = jnp.where(valid[:, None], out, 0)
    return out.astype(x.dtype)
