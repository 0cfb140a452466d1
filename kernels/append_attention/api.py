"""Public entry point of the append decode attention; `backend` picks the implementation.

One new row per sequence (a decode step) of a gated attention layer, from its fused projection row: q / k RMSNorm,
RoPE, the new k / v written into the caches, causal GQA attention over the cache, output * sigmoid(gate).

Backends:
  "reference"      plain jnp (kernels/append_attention/reference.py): the model's separate ops, ~8 XLA kernels
                   around the attention.
  "pallas_triton"  one Pallas launch plus the split merge (kernels/append_attention/pallas_triton.py).
  "auto"           "pallas_triton" when JAX's default backend is a GPU, else "reference".
"""

from __future__ import annotations

from kernels.append_attention.layout import HeadLayout
from kernels.append_attention.pallas_triton import append_decode_attention_triton
from kernels.append_attention.reference import append_decode_attention_reference
from kernels.dispatch import pick_backend

BACKENDS = {"reference": append_decode_attention_reference, "pallas_triton": append_decode_attention_triton}
ROPE_STYLES = ("rotate_half", "interleaved")


def append_decode_attention(proj, q_norm, k_norm, k_cache, v_cache, start, new_lengths, *, layout: HeadLayout,
                            rotary_dim: int, rope_theta: float, rope_style: str, eps: float,
                            zero_centered: bool = True, backend: str = "reference", **backend_kwargs):
    """proj [B, W] (W >= layout.chunks * head_dim): one fused projection row per sequence; q_norm, k_norm [head_dim]
    RMSNorm weights ((1 + w) when zero_centered); k_cache, v_cache [S, L, Hkv, head_dim], S >= B (rows [0, B) are
    the sequences: a slot pool's prefix); start [B] int: the new row's position (= the cache length before it; a
    row at >= L is not written and the whole cache is visible); new_lengths [B] int: 1 sees the new row, 0 attends
    to rows < start only (a free slot; its row is written either way). RoPE (`rope_style` in ROPE_STYLES) on the
    first `rotary_dim` dims of each head. Returns (o [B, Hq * head_dim] in proj.dtype, gated; k_cache; v_cache)."""
    S, L, Hkv, D = k_cache.shape
    if v_cache.shape != k_cache.shape or Hkv != layout.num_kv_heads or D != layout.head_dim:
        raise ValueError(f"caches {k_cache.shape} / {v_cache.shape} do not match {layout}")
    if proj.ndim != 2 or proj.shape[1] < layout.chunks * D or S < proj.shape[0]:
        raise ValueError(f"projection rows {proj.shape} do not hold {layout} for a pool of {S} slots")
    if rope_style not in ROPE_STYLES or rotary_dim % 2 or not 0 < rotary_dim <= D:
        raise ValueError(f"rope {rope_style!r} over {rotary_dim} of {D} dims is not supported")
    fn = pick_backend(BACKENDS, backend, "append attention", auto="pallas_triton")
    return fn(proj, q_norm, k_norm, k_cache, v_cache, start, new_lengths, layout=layout, rotary_dim=rotary_dim,
              rope_theta=rope_theta, rope_style=rope_style, eps=eps, zero_centered=zero_centered, **backend_kwargs)


__all__ = ["BACKENDS", "HeadLayout", "ROPE_STYLES", "append_decode_attention"]
