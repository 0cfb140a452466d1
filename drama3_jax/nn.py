"""Shared building blocks: linear/embedding modules named like the checkpoint, norms, SwiGLU, FP8 dequant (RoPE:
kernels/rope.py).

Numerics policy (one place): weights are stored in their checkpoint dtype (bf16; routed experts FP8 e4m3 with fp32
block scales); matmuls run in the weight dtype; norms, softmax and RoPE are computed in fp32. Zero-centred norm
gammas are applied as (1 + w) in fp32 (bf16 cannot resolve 1 + w near 1).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kernels.attention import attention
from kernels.dense.api import linear
from kernels.norm.api import add_rms_norm, rms_norm


class Linear(nnx.Module):
    """y = x @ weight.T, with `weight` [out, in] exactly as the checkpoint stores it (no bias). `dense` picks the
    implementation (kernels/dense/api.py: XLA's GEMM, or the Pallas kernel for decode-sized calls)."""

    def __init__(self, in_features: int, out_features: int, *, dtype=jnp.bfloat16):
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), dtype))

    def __call__(self, x: jax.Array, dense: str = "reference") -> jax.Array:
        return linear(x, self.weight[...], backend=dense)


class FusedLinear(nnx.Module):
    """Projections of the same input as one GEMM: `weight` [sum(out_i), in] stacks the members' [out, in] weights in
    order; returns the members' outputs [..., out_i]. Built from checkpoint-layout `Linear`s by `fuse_projections`
    (one launch and one weight stream instead of several, which decode-sized calls are latency-bound on)."""

    def __init__(self, members, align: int = 64):
        ws = [m.weight[...] for m in members]
        self.sizes = tuple(int(w.shape[0]) for w in ws)
        pad = -sum(self.sizes) % align  # zero rows, so that the GEMM's output rows stay aligned (e.g. 256 + 2 * 512 + 1)
        self.weight = nnx.Param(jnp.concatenate(ws + [jnp.zeros((pad, ws[0].shape[1]), ws[0].dtype)], axis=0))
        self.columns = tuple(int(c) for c in np.cumsum((0,) + self.sizes[:-1]))  # each member's first output column

    def project(self, x: jax.Array, dense: str = "reference", out_dtype=None) -> jax.Array:
        """The one GEMM's output [..., sum(out_i) + padding]: member i in columns [columns[i], + sizes[i]). For
        kernels that read their operands in place (a slice passed to a custom call is a copy kernel)."""
        return linear(x, self.weight[...], backend=dense, out_dtype=out_dtype)

    def __call__(self, x: jax.Array, dense: str = "reference", out_dtype=None) -> list[jax.Array]:
        y = self.project(x, dense, out_dtype)
        return jnp.split(y, np.cumsum(self.sizes).tolist(), axis=-1)[:len(self.sizes)]


class Embedding(nnx.Module):
    """Row lookup in `weight` [num, dim]."""

    def __init__(self, num: int, dim: int, *, dtype=jnp.bfloat16):
        self.weight = nnx.Param(jnp.zeros((num, dim), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis. `zero_centered`: y = x_hat * (1 + w) (Qwen3.5 / tower); else y = x_hat * w."""

    def __init__(self, dim: int, eps: float, *, zero_centered: bool = True, dtype=jnp.bfloat16):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype) if zero_centered else jnp.ones((dim,), dtype))
        self.eps = eps
        self.zero_centered = zero_centered

    def __call__(self, x: jax.Array, out_dtype=None) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps, zero_centered=self.zero_centered,
                        out_dtype=out_dtype or x.dtype)

    def with_residual(self, x: jax.Array, residual: jax.Array, backend: str, quant_group: int | None = None):
        """x, residual [..., dim] (same dtype) -> (s = x + residual, self(s)[, self(s)'s e4m3 groups or None]) as one
        launch of the norm kernel `backend` (kernels/norm/api.py)."""
        shape = x.shape
        s, y, *q = add_rms_norm(x.reshape(-1, shape[-1]), residual.reshape(-1, shape[-1]), self.weight[...],
                                eps=self.eps, zero_centered=self.zero_centered, quant_group=quant_group,
                                backend=backend)
        return s.reshape(shape), y.reshape(shape), tuple(q) or None


def write_rows(cache: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """cache [S, L, ...] <- new [B, T, ...] at per-row offsets start [B] (a KV-cache write) into rows [0, B) of the
    cache (S >= B: a decode step over a prefix of the slot pool scatters in place, rows past L dropped)."""
    B, T = new.shape[:2]
    if B < cache.shape[0]:
        cols = start[:, None].astype(jnp.int32) + jnp.arange(T, dtype=jnp.int32)[None, :]
        return cache.at[jnp.arange(B)[:, None], cols].set(new.astype(cache.dtype), mode="drop")
    upd = lambda c, n, s: jax.lax.dynamic_update_slice(c, n.astype(c.dtype), (s,) + (0,) * (c.ndim - 1))
    return jax.vmap(upd)(cache, new, start)


def gated_cached_attention(q, k, v, gate, positions, k_cache, v_cache, start, new_lengths, *, fresh: bool,
                           backend: str):
    """Write k, v [B, T, n_kv, D] into the caches at `start` [B], attend causally (over the new rows only when
    `fresh`, else over the cache), multiply by sigmoid(gate) [B, T, n_q * D]. The caches may hold more rows than B
    (a decode step over rows [0, B) of a slot pool).
    Returns (o [B, T, n_q * D], k_cache, v_cache)."""
    B, T, _, hd = q.shape
    with jax.named_scope("kv_write"):  # profile categories (experiments/decode_profile.py)
        k_cache = write_rows(k_cache, k, start)
        v_cache = write_rows(v_cache, v, start)
    with jax.named_scope("attention_core"):
        if fresh:
            o = attention(q, k.astype(q.dtype), v.astype(q.dtype), positions, new_lengths, scale=hd ** -0.5,
                          backend=backend)
        else:
            o = attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), positions, start + new_lengths,
                          scale=hd ** -0.5, backend=backend)
    o = o.reshape(B, T, -1) * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(o.dtype)
    return o, k_cache, v_cache


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


# ------------------------------------------------------------------------------------------ block FP8
def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of the fp32 `weight_scale_inv` for a [..., out, in] weight: [..., ceil(out/b0), ceil(in/b1)]."""
    return tuple(shape[:-2]) + (math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def dequantize_block_fp8(w: jax.Array, scale: jax.Array, block: tuple[int, int], dtype=jnp.float32) -> jax.Array:
    """W = fp8(w) * scale broadcast over each block (partial edge blocks allowed). w [..., out, in]."""
    out_dim, in_dim = w.shape[-2:]
    s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), block[0], axis=-2), block[1], axis=-1)
    s = s[..., :out_dim, :in_dim]
    return (w.astype(jnp.float32) * s).astype(dtype)


def quantize_block_fp8(w, block: tuple[int, int], xp=np):
    """Per-block absmax quantisation to e4m3 with fp32 scales (W ~= fp8 * scale). w [..., out, in] float.
    xp = numpy (host, writing checkpoints) or jax.numpy (on device, random-weight models)."""
    w = xp.asarray(w, xp.float32)
    out_dim, in_dim = w.shape[-2:]
    sshape = scale_shape(w.shape, block)
    po, pi = sshape[-2] * block[0] - out_dim, sshape[-1] * block[1] - in_dim
    wp = xp.pad(w, [(0, 0)] * (w.ndim - 2) + [(0, po), (0, pi)])
    blocks = wp.reshape(w.shape[:-2] + (sshape[-2], block[0], sshape[-1], block[1]))
    amax = xp.abs(blocks).max(axis=(-3, -1))
    scale = xp.where(amax > 0, amax / 448.0, 1.0).astype(xp.float32)  # 448 = e4m3 max finite
    q = blocks / scale[..., :, None, :, None]
    q = q.reshape(wp.shape)[..., :out_dim, :in_dim].astype(jnp.float8_e4m3fn)
    return q, scale
