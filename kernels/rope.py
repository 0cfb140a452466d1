"""Rotary position embeddings in fp32 (plain jnp): the tables and the two pair layouts Drama 3 uses (rotate-half in
the backbone, interleaved GPT-J pairs in the tower). The model (drama3_jax/nn.py) and the kernels' references share
them."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope_inv_freq(rotary_dim: int, theta: float) -> jax.Array:
    return 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))


def apply_rope_rotate_half(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """NeoX-style ("rotate half") RoPE on the first `rotary_dim` dims of each head, fp32 math.

    x [B, T, H, D]; positions [B, T] int."""
    inv = rope_inv_freq(rotary_dim, theta)
    ang = positions.astype(jnp.float32)[..., None] * inv  # [B, T, rot/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    half = rotary_dim // 2
    x1, x2, rest = xf[..., :half], xf[..., half:rotary_dim], xf[..., rotary_dim:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x.dtype)


def apply_rope_interleaved(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """GPT-J style RoPE on adjacent pairs (x[2i], x[2i+1]) of the first `rotary_dim` dims, fp32 math."""
    inv = rope_inv_freq(rotary_dim, theta)
    ang = positions.astype(jnp.float32)[..., None] * inv
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    pairs = xf[..., :rotary_dim].reshape(xf.shape[:-1] + (rotary_dim // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rot = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(xf.shape[:-1] + (rotary_dim,))
    return jnp.concatenate([rot, xf[..., rotary_dim:]], axis=-1).astype(x.dtype)
