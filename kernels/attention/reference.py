"""Plain-jnp causal GQA attention with explicit key positions.

q [B, Tq, Hq, D] with query positions q_pos [B, Tq]; k, v [B, Tk, Hkv, D]; key j of batch b is visible to query i
iff j <= q_pos[b, i] and j < kv_len[b]. Softmax in fp32; returns [B, Tq, Hq, D] in q.dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_reference(q, k, v, q_pos, kv_len, *, scale: float):
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    qg = q.reshape(B, Tq, Hkv, rep, D)
    s = jnp.einsum("bqgrd,bkgd->bgrqk", qg, k, preferred_element_type=jnp.float32) * scale
    kpos = jnp.arange(Tk)
    mask = (kpos[None, None, :] <= q_pos[:, :, None]) & (kpos[None, None, :] < kv_len[:, None, None])  # [B,Tq,Tk]
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask[:, None, None], p, 0.0)  # rows with no visible key (padding) give 0, not NaN
    o = jnp.einsum("bgrqk,bkgd->bqgrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, Tq, Hq, D).astype(q.dtype)
