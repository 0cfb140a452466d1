"""The codec's causal window-limited transformer (fish-speech modded_dac.py `WindowLimitedTransformer`), streamable.

Per block: h = x + gamma_1 * wo(Attn(RMSNorm(x))); out = h + gamma_2 * w2(silu(w1 n) * w3 n), n = RMSNorm(h); then a
final RMSNorm (plain weight, eps 1e-5). Attention: fused wqkv, RoPE on interleaved pairs over the full head_dim with
base 10000, softmax over the keys at positions p - window + 1 .. p. The streaming state per layer is the rotated K and
V of the window - 1 positions before the chunk ([B, window - 1, H, head_dim]); a stream's first positions see
context slots at negative positions, which are masked, so one-shot and streamed runs are the same computation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from drama3_jax.codec.config import CodecTransformerConfig
from drama3_jax.codec.layers import next_context
from drama3_jax.nn import Linear, RMSNorm, swiglu
from kernels.rope import rope_inv_freq

_FAR = 1 << 30  # position given to padding queries/keys: they only see each other


def apply_rope_bf16_table(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Interleaved-pair RoPE over the full head dim with cos/sin rounded to bf16, as fish-speech modded_dac.py
    `precompute_freqs_cis` stores its table (dtype=torch.bfloat16) even in an fp32 model. x [B, T, H, D]; positions
    [B, T] int. Rotation in fp32, result in x's dtype."""
    ang = positions.astype(jnp.float32)[..., None] * rope_inv_freq(x.shape[-1], base)
    cos = jnp.cos(ang).astype(jnp.bfloat16).astype(jnp.float32)[:, :, None, :]
    sin = jnp.sin(ang).astype(jnp.bfloat16).astype(jnp.float32)[:, :, None, :]
    pairs = x.astype(jnp.float32).reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape).astype(x.dtype)


def _dense_window_attention(q, k, v, q_pos, k_pos, window):
    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    rel = q_pos[:, :, None] - k_pos[:, None, :]
    visible = (rel >= 0) & (rel < window) & (k_pos >= 0)[:, None, :]
    probs = jax.nn.softmax(jnp.where(visible[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)


def window_attention(q, k, v, q_pos, k_pos, window: int):
    """Causal attention limited to the last `window` positions. q [B, T, H, D] at q_pos [B, T]; k, v [B, S, H, D] at
    k_pos [B, S] with S = window - 1 + T (context slots, then the chunk). Keys at negative positions are masked.
    Chunks longer than the window are split into window-sized query blocks that each see 2 * window keys, so memory
    grows linearly with T."""
    B, T, H, D = q.shape
    if T <= window:
        return _dense_window_attention(q, k, v, q_pos, k_pos, window)
    nb = -(-T // window)
    pad = nb * window - T
    pad_time = lambda a, front, back, value=0: jnp.pad(  # noqa: E731
        a, ((0, 0), (front, back)) + ((0, 0),) * (a.ndim - 2), constant_values=value)
    q, q_pos = pad_time(q, 0, pad), pad_time(q_pos, 0, pad, _FAR)
    k, v = pad_time(k, 1, pad), pad_time(v, 1, pad)  # one masked slot in front: (nb + 1) whole blocks
    k_pos = pad_time(pad_time(k_pos, 1, 0, -1), 0, pad, _FAR)

    def key_blocks(a):  # [B, (nb+1)*W, ...] -> [B*nb, 2W, ...]: block j sees key blocks j and j+1
        a = a.reshape((B, nb + 1, window) + a.shape[2:])
        return jnp.concatenate([a[:, :-1], a[:, 1:]], axis=2).reshape((B * nb, 2 * window) + a.shape[3:])

    o = _dense_window_attention(q.reshape(B * nb, window, H, D), key_blocks(k), key_blocks(v),
                                q_pos.reshape(B * nb, window), key_blocks(k_pos), window)
    return o.reshape(B, nb * window, H, D)[:, :T]


class LayerScale(nnx.Module):
    def __init__(self, dim: int, *, dtype):
        self.gamma = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x):
        return x * self.gamma[...]


class Attention(nnx.Module):
    """wqkv [3 * H * D, dim] (q | k | v rows), wo [dim, H * D]."""

    def __init__(self, cfg: CodecTransformerConfig, *, dtype):
        self.wqkv = Linear(cfg.dim, 3 * cfg.n_head * cfg.head_dim, dtype=dtype)
        self.wo = Linear(cfg.n_head * cfg.head_dim, cfg.dim, dtype=dtype)
        self.cfg = cfg

    def __call__(self, x, positions, k_ctx, v_ctx, start, n_valid):
        cfg = self.cfg
        B, T, _ = x.shape
        q, k, v = jnp.split(self.wqkv(x).reshape(B, T, 3 * cfg.n_head, cfg.head_dim), 3, axis=2)
        q = apply_rope_bf16_table(q, positions, cfg.rope_base)
        k = apply_rope_bf16_table(k, positions, cfg.rope_base)
        k_ext = jnp.concatenate([k_ctx.astype(k.dtype), k], axis=1)
        v_ext = jnp.concatenate([v_ctx.astype(v.dtype), v], axis=1)
        k_pos = start[:, None] + jnp.arange(1 - cfg.window, T, dtype=jnp.int32)[None, :]
        o = window_attention(q, k_ext, v_ext, positions, k_pos, cfg.window)
        ctx = cfg.window - 1
        return (self.wo(o.reshape(B, T, cfg.n_head * cfg.head_dim)),
                next_context(k_ext, ctx, n_valid), next_context(v_ext, ctx, n_valid))


class FeedForward(nnx.Module):
    def __init__(self, cfg: CodecTransformerConfig, *, dtype):
        self.w1 = Linear(cfg.dim, cfg.intermediate_size, dtype=dtype)
        self.w3 = Linear(cfg.dim, cfg.intermediate_size, dtype=dtype)
        self.w2 = Linear(cfg.intermediate_size, cfg.dim, dtype=dtype)

    def __call__(self, x):
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class TransformerBlock(nnx.Module):
    def __init__(self, cfg: CodecTransformerConfig, *, dtype):
        self.attention = Attention(cfg, dtype=dtype)
        self.feed_forward = FeedForward(cfg, dtype=dtype)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, zero_centered=False, dtype=dtype)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, zero_centered=False, dtype=dtype)
        self.attention_layer_scale = LayerScale(cfg.dim, dtype=dtype)
        self.ffn_layer_scale = LayerScale(cfg.dim, dtype=dtype)


class WindowLimitedTransformer(nnx.Module):
    """x [B, T, dim] at positions start[b] + t -> (y [B, T, dim], next context). Context: per layer (k, v), each
    [B, window - 1, n_head, head_dim]; None = fresh streams."""

    def __init__(self, cfg: CodecTransformerConfig, *, dtype):
        self.layers = nnx.List([TransformerBlock(cfg, dtype=dtype) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, zero_centered=False, dtype=dtype)
        self.cfg = cfg

    def init_state(self, batch: int, dtype) -> list:
        c = self.cfg
        zeros = lambda: jnp.zeros((batch, c.window - 1, c.n_head, c.head_dim), dtype)  # noqa: E731
        return [(zeros(), zeros()) for _ in range(c.n_layer)]

    def __call__(self, x, ctx=None, start=None, n_valid=None):
        B, T, _ = x.shape
        if ctx is None:
            ctx = self.init_state(B, x.dtype)
        if start is None:
            start = jnp.zeros((B,), jnp.int32)
        positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        next_ctx = []
        for layer, (k_ctx, v_ctx) in zip(self.layers, ctx):
            a, k_ctx, v_ctx = layer.attention(layer.attention_norm(x), positions, k_ctx, v_ctx, start, n_valid)
            x = x + layer.attention_layer_scale(a).astype(x.dtype)
            x = x + layer.ffn_layer_scale(layer.feed_forward(layer.ffn_norm(x))).astype(x.dtype)
            next_ctx.append((k_ctx, v_ctx))
        return self.norm(x), next_ctx
