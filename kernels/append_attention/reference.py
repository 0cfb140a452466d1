"""Plain-jnp truth of the append decode attention: the model's separate ops in order (q / k RMSNorm, RoPE, KV-cache
write, causal GQA attention, sigmoid output gate). `attention_backend` picks the attention step (kernels/attention):
its plain-jnp reference by default, or "pallas_triton", the decode kernel the model's separate ops run on a GPU (the
baseline of experiments/append_attention_bench.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels.append_attention.layout import HeadLayout
from kernels.attention.api import attention
from kernels.norm.reference import rms_norm
from kernels.rope import apply_rope_interleaved, apply_rope_rotate_half

ROPE = {"rotate_half": apply_rope_rotate_half, "interleaved": apply_rope_interleaved}


def split_heads(proj, layout: HeadLayout):
    """proj [B, C * D] -> q [B, Hq, D], gate [B, Hq, D], k [B, Hkv, D], v [B, Hkv, D] (views of the row's chunks)."""
    B, D = proj.shape[0], layout.head_dim
    p = proj[:, :layout.chunks * D].reshape(B, layout.chunks, D)
    return p[:, layout.q_chunks()], p[:, layout.gate_chunks()], p[:, layout.k_chunks()], p[:, layout.v_chunks()]


def append_decode_attention_reference(proj, q_norm, k_norm, k_cache, v_cache, start, new_lengths, *,
                                      layout: HeadLayout, rotary_dim: int, rope_theta: float, rope_style: str,
                                      eps: float, zero_centered: bool = True, attention_backend: str = "reference",
                                      **attention_kwargs):
    """See api.append_decode_attention; `attention_backend` / `attention_kwargs`: see the module doc."""
    B, D = proj.shape[0], layout.head_dim
    q, gate, k, v = split_heads(proj, layout)
    pos = start.astype(jnp.int32)[:, None]                                      # [B, 1]
    rope = ROPE[rope_style]
    q = rope(rms_norm(q, q_norm, eps, zero_centered=zero_centered)[:, None], pos, rotary_dim, rope_theta)
    k = rope(rms_norm(k, k_norm, eps, zero_centered=zero_centered)[:, None], pos, rotary_dim, rope_theta)
    rows = jnp.arange(B)[:, None]
    k_cache = k_cache.at[rows, pos].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, pos].set(v[:, None].astype(v_cache.dtype), mode="drop")
    o = attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), pos, start + new_lengths, scale=D ** -0.5,
                  backend=attention_backend, **attention_kwargs)[:, 0]           # [B, Hq, D]
    o = o * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
    return o.reshape(B, -1), k_cache, v_cache
