"""Causal convolution building blocks of the ModifiedDAC codec, channels-last ([B, T, C]) and streamable.

Every layer that looks back in time takes `ctx`, the last `context` input samples before `x` ([B, context, C_in];
zeros, or None, at a stream's start) and returns `(y, next_ctx)`. `n_valid` ([B] int, or None = all of `x`) counts
the real samples of `x` per stream; `next_ctx` then ends at each stream's last real sample, so streams that received
fewer new samples in a batched call stay exact. Every layer is causal, so padded samples never reach real outputs.

Numerics follow fish-speech modded_dac.py / descript-audio-codec layers.py: Snake x + 1/(alpha + 1e-9) sin^2(alpha x);
LayerNorm eps 1e-6; exact (erf) GELU in ConvNeXt.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from drama3_jax.nn import Linear
from kernels.snake_linear.api import snake, snake_linear_residual, supports


def _extend(x: jax.Array, ctx: jax.Array | None, size: int) -> jax.Array:
    """[ctx, x] along time; ctx None = a fresh stream (zeros)."""
    if ctx is None:
        return jnp.pad(x, ((0, 0), (size, 0), (0, 0)))
    return jnp.concatenate([ctx.astype(x.dtype), x], axis=1)


def next_context(ext: jax.Array, size: int, n_valid: jax.Array | None) -> jax.Array:
    """The `size` input samples before the next chunk: the last `size` real samples of `ext` [B, S, C], whose real
    part is its first S - T + n_valid samples."""
    if size == 0:
        return ext[:, :0]
    if n_valid is None:
        return ext[:, ext.shape[1] - size:]
    return jax.vmap(lambda e, n: jax.lax.dynamic_slice_in_dim(e, n, size, axis=0))(ext, n_valid)


class BiasedLinear(Linear):
    """y = x @ weight.T + bias; weight [out, in] (torch Linear / 1x1 Conv1d orientation), bias [out]."""

    def __init__(self, in_features: int, out_features: int, *, dtype):
        super().__init__(in_features, out_features, dtype=dtype)
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return super().__call__(x) + self.bias[...]


class Snake(nnx.Module):
    """Snake activation with per-channel alpha [C]; fp32 math (kernels/snake_linear/reference.py `snake`)."""

    def __init__(self, channels: int, *, dtype):
        self.alpha = nnx.Param(jnp.ones((channels,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return snake(x, self.alpha[...])


# 1x1 convs (the residual units' conv2) as a matmul over the channels rather than a cuDNN conv: in XLA a GEMM may take
# the Snake before it as a fused operand computation and the residual add after it as its epilogue, where a cuDNN conv
# stays a call of its own between two elementwise passes (the 128-stream codec call spends ~0.8 ms per residual unit
# on those passes at the two widest rates: experiments/results/profiles_2026-12-04/codec/). On the H200 the 128 x 8
# streaming call took 31.00 against 31.65 ms as cuDNN convs, the 8 x 4 one 6.46 against 6.91 ms
# (experiments/results/ab_2026-12-04/codec/; `codec_throughput.py --variants default pointwise_conv` is the A/B).
POINTWISE_AS_MATMUL = True

# The residual units' tail (Snake, the 1x1 matmul, its bias, the residual add) as one op (kernels/snake_linear):
# "reference" is the plain-jnp math, which XLA runs as a Snake pass, the GEMM and the add left to the sum's consumers;
# "auto" takes the one-launch Pallas kernel on a GPU. It applies with POINTWISE_AS_MATMUL at widths the kernel was
# compiled for without spills (multiples of 16 up to TAIL_KERNEL_MAX_CHANNELS). Off until timed on the H200
# (`codec_throughput.py --variants default snake_linear_kernel snake_linear_kernel_4warps` is the A/B).
TAIL_BACKEND = "reference"
TAIL_KERNEL_MAX_CHANNELS = 384


class CausalConv1d(nnx.Module):
    """Causal conv: left context (k-1)*dilation + 1 - stride, then a valid conv. weight [k, C_in, C_out], bias [C_out].
    With stride > 1 the chunk length must be a multiple of the stride (the encoder pads audio to whole frames)."""

    def __init__(self, c_in: int, c_out: int, kernel: int, *, stride: int = 1, dilation: int = 1, dtype):
        self.weight = nnx.Param(jnp.zeros((kernel, c_in, c_out), dtype))
        self.bias = nnx.Param(jnp.zeros((c_out,), dtype))
        self.stride, self.dilation = stride, dilation
        self.context = (kernel - 1) * dilation + 1 - stride

    def init_state(self, batch: int, dtype) -> jax.Array:
        return jnp.zeros((batch, self.context, self.weight.shape[1]), dtype)

    def __call__(self, x, ctx=None, n_valid=None):
        if x.shape[1] % self.stride:
            raise ValueError(f"CausalConv1d: chunk length {x.shape[1]} is not a multiple of stride {self.stride}")
        w = self.weight[...]
        if w.shape[0] == 1 and self.stride == 1 and POINTWISE_AS_MATMUL:  # no context: nothing to carry
            y = jax.lax.dot_general(x.astype(w.dtype), w[0], (((2,), (0,)), ((), ())))
            return y + self.bias[...], x[:, :0]
        ext = _extend(x, ctx, self.context)
        y = jax.lax.conv_general_dilated(ext.astype(w.dtype), w, (self.stride,), "VALID",
                                         rhs_dilation=(self.dilation,), dimension_numbers=("NWC", "WIO", "NWC"))
        return y + self.bias[...], next_context(ext, self.context, n_valid)


class CausalDepthwiseConv1d(nnx.Module):
    """Causal depthwise conv (ConvNeXt `dwconv`): y[t] = b + sum_j w[j] * x[t - (k-1) + j]. weight [k, C], bias [C]."""

    def __init__(self, channels: int, kernel: int, *, dtype):
        self.weight = nnx.Param(jnp.zeros((kernel, channels), dtype))
        self.bias = nnx.Param(jnp.zeros((channels,), dtype))
        self.context = kernel - 1

    def init_state(self, batch: int, dtype) -> jax.Array:
        return jnp.zeros((batch, self.context, self.weight.shape[1]), dtype)

    def __call__(self, x, ctx=None, n_valid=None):
        ext = _extend(x, ctx, self.context)
        w, T = self.weight[...], x.shape[1]
        y = sum(ext[:, j:j + T] * w[j] for j in range(w.shape[0]))
        return y + self.bias[...], next_context(ext, self.context, n_valid)


class CausalConvTranspose1d(nnx.Module):
    """Transposed conv (kernel = taps * stride) with the last kernel - stride outputs trimmed, as a polyphase matmul:
    y[i*s + r] = bias + sum_h x[i - h] @ W[:, h*s + r, :]. weight [C_in, k, C_out] (so [C_in * taps, s * C_out] is a
    plain reshape), bias [C_out]; context = taps - 1 previous inputs."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int, *, dtype):
        if kernel % stride:
            raise ValueError(f"CausalConvTranspose1d: kernel {kernel} is not a multiple of stride {stride}")
        self.weight = nnx.Param(jnp.zeros((c_in, kernel, c_out), dtype))
        self.bias = nnx.Param(jnp.zeros((c_out,), dtype))
        self.stride = stride
        self.context = kernel // stride - 1

    def init_state(self, batch: int, dtype) -> jax.Array:
        return jnp.zeros((batch, self.context, self.weight.shape[0]), dtype)

    def __call__(self, x, ctx=None, n_valid=None):
        B, T, c_in = x.shape
        w = self.weight[...]
        taps, c_out = self.context + 1, w.shape[2]
        ext = _extend(x, ctx, self.context)
        lagged = jnp.stack([ext[:, taps - 1 - h:taps - 1 - h + T] for h in range(taps)], axis=-1)  # [B, T, C_in, h]
        y = jax.lax.dot_general(lagged.reshape(B, T, c_in * taps).astype(w.dtype),
                                w.reshape(c_in * taps, self.stride * c_out), (((2,), (0,)), ((), ())))
        y = y.reshape(B, T * self.stride, c_out) + self.bias[...]
        return y, next_context(ext, self.context, n_valid)


class ResidualUnit(nnx.Module):
    """x + conv2(snake2(conv1(snake1(x)))): conv1 k7 with dilation d, conv2 k1 (fish `ResidualUnit`, causal)."""

    def __init__(self, channels: int, dilation: int, *, dtype):
        self.snake1 = Snake(channels, dtype=dtype)
        self.conv1 = CausalConv1d(channels, channels, 7, dilation=dilation, dtype=dtype)
        self.snake2 = Snake(channels, dtype=dtype)
        self.conv2 = CausalConv1d(channels, channels, 1, dtype=dtype)

    def init_state(self, batch, dtype):
        return self.conv1.init_state(batch, dtype)

    def __call__(self, x, ctx=None, n_valid=None):
        y, ctx = self.conv1(self.snake1(x), ctx, n_valid)
        B, T, C = x.shape
        if POINTWISE_AS_MATMUL and C <= TAIL_KERNEL_MAX_CHANNELS and supports(C, C):
            out = snake_linear_residual(y.reshape(B * T, C), self.snake2.alpha[...], self.conv2.weight[...][0],
                                        self.conv2.bias[...], x.reshape(B * T, C), backend=TAIL_BACKEND)
            return out.reshape(B, T, C), ctx
        y, _ = self.conv2(self.snake2(y), None)
        return x + y.astype(x.dtype), ctx


class LayerNorm(nnx.Module):
    """torch LayerNorm over the last axis (biased variance), fp32 math; weight, bias [C]."""

    def __init__(self, dim: int, eps: float, *, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class ConvNeXtBlock(nnx.Module):
    """x + gamma * pwconv2(gelu(pwconv1(norm(dwconv(x))))): causal depthwise k7, LayerNorm eps 1e-6, MLP ratio 4."""

    def __init__(self, dim: int, *, dtype):
        self.dwconv = CausalDepthwiseConv1d(dim, 7, dtype=dtype)
        self.norm = LayerNorm(dim, 1e-6, dtype=dtype)
        self.pwconv1 = BiasedLinear(dim, 4 * dim, dtype=dtype)
        self.pwconv2 = BiasedLinear(4 * dim, dim, dtype=dtype)
        self.gamma = nnx.Param(jnp.ones((dim,), dtype))

    def init_state(self, batch, dtype):
        return self.dwconv.init_state(batch, dtype)

    def __call__(self, x, ctx=None, n_valid=None):
        y, ctx = self.dwconv(x, ctx, n_valid)
        h = self.pwconv1(self.norm(y))
        h = jax.nn.gelu(h.astype(jnp.float32), approximate=False).astype(h.dtype)
        return x + (self.gamma[...] * self.pwconv2(h)).astype(x.dtype), ctx
