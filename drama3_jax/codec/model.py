"""ModifiedDAC (fish-speech modded_dac.py `DAC` + rvq.py `DownsampleResidualVectorQuantize`) in Flax NNX.

Module tree (checkpoint names in drama3_jax/codec/convert.py):
  encoder:   conv_in -> blocks[i] (units[0..2] -> snake -> downsample conv k2s s, + transformer on the last)
             -> snake_out -> conv_out
  quantizer: downsample[i] (conv k2 s2 + convnext), pre_module, semantic_quantizer.quantizers[0],
             quantizer.quantizers[0..8], post_module, upsample[i] (transposed conv k2 s2 + convnext)
  decoder:   conv_in -> blocks[i] (snake -> upsample transposed conv k2s s -> units[0..2]) -> snake_out -> conv_out
All activations are channels-last [B, T, C]; dtype follows the weights (fp32 for parity, bf16 for serving).

Decode (codes [B, K, T] -> audio [B, T * frame_length]) is one streaming step from a fresh `DecodeState`; `decode_step`
continues any streams from their state (drama3_jax/codec/streaming.py wraps it for serving).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from drama3_jax.codec.config import CodecConfig
from drama3_jax.codec.layers import (
    BiasedLinear,
    CausalConv1d,
    CausalConvTranspose1d,
    ConvNeXtBlock,
    ResidualUnit,
    Snake,
)
from drama3_jax.codec.transformer import WindowLimitedTransformer
from drama3_jax.nn import Embedding

DILATIONS = (1, 3, 9)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Per-stream decoder state. frames [B] int32: frames decoded so far. post_module: per layer (k, v) window
    context. upsample / decoder: left contexts of every causal conv, nested like the modules."""

    frames: jax.Array
    post_module: list
    upsample: list
    decoder: dict


# ------------------------------------------------------------------------------------------------ encoder
class EncoderBlock(nnx.Module):
    def __init__(self, dim: int, stride: int, transformer, *, dtype):
        self.units = nnx.List([ResidualUnit(dim // 2, d, dtype=dtype) for d in DILATIONS])
        self.snake = Snake(dim // 2, dtype=dtype)
        self.downsample = CausalConv1d(dim // 2, dim, 2 * stride, stride=stride, dtype=dtype)
        self.transformer = None if transformer is None else WindowLimitedTransformer(transformer, dtype=dtype)

    def __call__(self, x):
        for unit in self.units:
            x, _ = unit(x)
        x, _ = self.downsample(self.snake(x))
        if self.transformer is not None:
            x, _ = self.transformer(x)
        return x


class Encoder(nnx.Module):
    """audio [B, N, 1] (N a multiple of hop_length) -> latent [B, N / hop_length, latent_dim]."""

    def __init__(self, cfg: CodecConfig, *, dtype):
        dims = cfg.encoder_dims
        self.conv_in = CausalConv1d(1, cfg.encoder_dim, 7, dtype=dtype)
        self.blocks = nnx.List([
            EncoderBlock(d, s, cfg.encoder_transformer if i == len(dims) - 1 else None, dtype=dtype)
            for i, (d, s) in enumerate(zip(dims, cfg.encoder_rates))])
        self.snake_out = Snake(dims[-1], dtype=dtype)
        self.conv_out = CausalConv1d(dims[-1], cfg.latent_dim, 3, dtype=dtype)

    def __call__(self, x):
        x, _ = self.conv_in(x)
        for block in self.blocks:
            x = block(x)
        return self.conv_out(self.snake_out(x))[0]


# ------------------------------------------------------------------------------------------------ decoder
class DecoderBlock(nnx.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, *, dtype):
        self.snake = Snake(c_in, dtype=dtype)
        self.upsample = CausalConvTranspose1d(c_in, c_out, 2 * stride, stride, dtype=dtype)
        self.units = nnx.List([ResidualUnit(c_out, d, dtype=dtype) for d in DILATIONS])
        self.stride = stride

    def init_state(self, batch, dtype):
        return {"upsample": self.upsample.init_state(batch, dtype),
                "units": [u.init_state(batch, dtype) for u in self.units]}

    def __call__(self, x, state, n_valid):
        x, up = self.upsample(self.snake(x), state["upsample"], n_valid)
        n_valid = None if n_valid is None else n_valid * self.stride
        units = []
        for unit, ctx in zip(self.units, state["units"]):
            x, ctx = unit(x, ctx, n_valid)
            units.append(ctx)
        return x, {"upsample": up, "units": units}


class Decoder(nnx.Module):
    """latent [B, T, latent_dim] -> audio [B, T * prod(decoder_rates)] in [-1, 1]."""

    def __init__(self, cfg: CodecConfig, *, dtype):
        dims = cfg.decoder_dims
        self.conv_in = CausalConv1d(cfg.latent_dim, dims[0], 7, dtype=dtype)
        self.blocks = nnx.List([DecoderBlock(dims[i], dims[i + 1], s, dtype=dtype)
                                for i, s in enumerate(cfg.decoder_rates)])
        self.snake_out = Snake(dims[-1], dtype=dtype)
        self.conv_out = CausalConv1d(dims[-1], 1, 7, dtype=dtype)

    def init_state(self, batch, dtype):
        return {"conv_in": self.conv_in.init_state(batch, dtype),
                "blocks": [b.init_state(batch, dtype) for b in self.blocks],
                "conv_out": self.conv_out.init_state(batch, dtype)}

    def __call__(self, x, state, n_valid):
        x, conv_in = self.conv_in(x, state["conv_in"], n_valid)
        blocks = []
        for block, s in zip(self.blocks, state["blocks"]):
            x, s = block(x, s, n_valid)
            blocks.append(s)
            n_valid = None if n_valid is None else n_valid * block.stride
        y, conv_out = self.conv_out(self.snake_out(x), state["conv_out"], n_valid)
        audio = jnp.tanh(y[..., 0].astype(jnp.float32))
        return audio, {"conv_in": conv_in, "blocks": blocks, "conv_out": conv_out}


# ---------------------------------------------------------------------------------------------- quantizer
class VectorQuantizer(nnx.Module):
    """Factorised cosine-similarity VQ (descript-audio-codec quantize.py): in_proj dim -> codebook_dim, codebook
    [size, codebook_dim], out_proj codebook_dim -> dim (both 1x1 convs with bias, weight norm folded)."""

    def __init__(self, dim: int, size: int, codebook_dim: int, *, dtype):
        self.in_proj = BiasedLinear(dim, codebook_dim, dtype=dtype)
        self.out_proj = BiasedLinear(codebook_dim, dim, dtype=dtype)
        self.codebook = Embedding(size, codebook_dim, dtype=dtype)

    def scores(self, residual):
        """residual [B, T, dim] -> (-squared distance of the L2-normalised projection to each normalised codebook
        row [B, T, size] fp32, the projection z_e [B, T, codebook_dim])."""
        z_e = self.in_proj(residual)
        normalise = lambda a: a / jnp.maximum(jnp.linalg.norm(a, axis=-1, keepdims=True), 1e-12)  # noqa: E731
        e = normalise(z_e.astype(jnp.float32))
        c = normalise(self.codebook.weight[...].astype(jnp.float32))
        dist = jnp.sum(e * e, -1, keepdims=True) - 2.0 * e @ c.T + jnp.sum(c * c, -1)
        return -dist, z_e

    def quantize(self, residual):
        """-> (codes [B, T] int32, quantized output [B, T, dim])."""
        scores, z_e = self.scores(residual)
        codes = jnp.argmax(scores, axis=-1).astype(jnp.int32)
        z_q = z_e + (self.codebook(codes) - z_e)  # straight-through form, as descript-audio-codec rounds it
        return codes, self.out_proj(z_q)

    def decode(self, codes):
        return self.out_proj(self.codebook(codes))


class ResidualQuantizer(nnx.Module):
    def __init__(self, n: int, dim: int, size: int, codebook_dim: int, *, dtype):
        self.quantizers = nnx.List([VectorQuantizer(dim, size, codebook_dim, dtype=dtype) for _ in range(n)])


class DownsampleStage(nnx.Module):
    def __init__(self, dim: int, factor: int, *, dtype):
        self.conv = CausalConv1d(dim, dim, factor, stride=factor, dtype=dtype)
        self.convnext = ConvNeXtBlock(dim, dtype=dtype)

    def __call__(self, x):
        return self.convnext(self.conv(x)[0])[0]


class UpsampleStage(nnx.Module):
    def __init__(self, dim: int, factor: int, *, dtype):
        self.conv = CausalConvTranspose1d(dim, dim, factor, factor, dtype=dtype)
        self.convnext = ConvNeXtBlock(dim, dtype=dtype)
        self.factor = factor

    def init_state(self, batch, dtype):
        return self.convnext.init_state(batch, dtype)

    def __call__(self, x, ctx, n_valid):
        x, _ = self.conv(x)  # kernel == stride: no context
        n_valid = None if n_valid is None else n_valid * self.factor
        x, ctx = self.convnext(x, ctx, n_valid)
        return x, ctx, n_valid


class Quantizer(nnx.Module):
    """Semantic VQ (1 codebook) + residual VQ on the downsampled, transformed latent; decode sums the codebook
    projections and runs post_module + upsample back to the latent rate."""

    def __init__(self, cfg: CodecConfig, *, dtype):
        d = cfg.latent_dim
        self.semantic_quantizer = ResidualQuantizer(1, d, cfg.semantic_codebook_size, cfg.codebook_dim, dtype=dtype)
        self.quantizer = ResidualQuantizer(cfg.n_residual_codebooks, d, cfg.codebook_size, cfg.codebook_dim,
                                           dtype=dtype)
        self.downsample = nnx.List([DownsampleStage(d, f, dtype=dtype) for f in cfg.downsample_factors])
        # fish rvq.py builds upsample stages in reverse order of the factors
        self.upsample = nnx.List([UpsampleStage(d, f, dtype=dtype) for f in reversed(cfg.downsample_factors)])
        self.pre_module = WindowLimitedTransformer(cfg.quantizer_transformer, dtype=dtype)
        self.post_module = WindowLimitedTransformer(cfg.quantizer_transformer, dtype=dtype)

    @property
    def vqs(self) -> list[VectorQuantizer]:
        """Codebook 0 (semantic), then the residual codebooks."""
        return [self.semantic_quantizer.quantizers[0], *self.quantizer.quantizers]

    def frame_latents(self, latent):
        """Encoder latent [B, 4T, dim] -> pre-quantisation frame latents [B, T, dim]."""
        for stage in self.downsample:
            latent = stage(latent)
        return self.pre_module(latent)[0]

    def quantize(self, z):
        """z [B, T, dim] -> codes [B, K, T]: semantic code on z, then each residual codebook on what is left after the
        semantic and earlier residual projections are subtracted."""
        codes = []
        for vq in self.vqs:
            c, z_q = vq.quantize(z)
            codes.append(c)
            z = z - z_q
        return jnp.stack(codes, axis=1)

    def embed(self, codes):
        """codes [B, K, T] (clipped to each codebook) -> summed projections [B, T, dim]: semantic + (sum of the
        residual ones), the order fish rvq.py `decode` adds them in."""
        z = [vq.decode(jnp.clip(codes[:, k], 0, vq.codebook.weight.shape[0] - 1)) for k, vq in enumerate(self.vqs)]
        residual = z[1]
        for z_k in z[2:]:
            residual = residual + z_k
        return z[0] + residual


# ---------------------------------------------------------------------------------------------------- codec
class ModifiedDAC(nnx.Module):
    def __init__(self, cfg: CodecConfig, *, dtype=jnp.float32):
        self.encoder = Encoder(cfg, dtype=dtype)
        self.quantizer = Quantizer(cfg, dtype=dtype)
        self.decoder = Decoder(cfg, dtype=dtype)
        self.cfg = cfg

    @property
    def dtype(self):
        return self.decoder.conv_in.weight.dtype

    def encode_frames(self, audio):
        """audio [B, N] mono at cfg.sample_rate, N a multiple of frame_length -> frame latents [B, N / frame_length,
        latent_dim] (before quantisation)."""
        return self.quantizer.frame_latents(self.encoder(audio[..., None].astype(self.dtype)))

    def encode(self, audio):
        """audio [B, N] (N a multiple of frame_length) -> codes [B, K, N / frame_length] int32."""
        return self.quantizer.quantize(self.encode_frames(audio))

    def init_decode_state(self, batch: int) -> DecodeState:
        dt = self.dtype
        return DecodeState(frames=jnp.zeros((batch,), jnp.int32),
                           post_module=self.quantizer.post_module.init_state(batch, dt),
                           upsample=[s.init_state(batch, dt) for s in self.quantizer.upsample],
                           decoder=self.decoder.init_state(batch, dt))

    def decode_step(self, state: DecodeState, codes, n_new=None):
        """Continue every stream by the frames codes [B, K, T] -> (audio [B, T * frame_length] fp32, next state).
        n_new [B] int (or None = T): real frames per stream; a stream's samples beyond n_new * frame_length are
        padding and its state advances by n_new frames only."""
        # named scopes: the categories of a codec profile (experiments/codec_throughput.py --profile-steps)
        with jax.named_scope("codec_embed"):
            z = self.quantizer.embed(codes).astype(self.dtype)
        with jax.named_scope("codec_post_module"):
            z, post = self.quantizer.post_module(z, state.post_module, state.frames, n_new)
        n_valid, upsample = n_new, []
        with jax.named_scope("codec_upsample"):
            for stage, ctx in zip(self.quantizer.upsample, state.upsample):
                z, ctx, n_valid = stage(z, ctx, n_valid)
                upsample.append(ctx)
        with jax.named_scope("codec_decoder"):
            audio, dec = self.decoder(z, state.decoder, n_valid)
        frames = state.frames + (codes.shape[2] if n_new is None else n_new.astype(jnp.int32))
        return audio, DecodeState(frames=frames, post_module=post, upsample=upsample, decoder=dec)

    def decode(self, codes):
        """codes [B, K, T] -> audio [B, T * frame_length] fp32."""
        return self.decode_step(self.init_decode_state(codes.shape[0]), codes)[0]
