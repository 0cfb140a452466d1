"""ModifiedDAC codec config (fish-speech `modded_dac_vq.yaml`, drama3-architecture.md section 4), full + tiny presets.

The real `codec.pth` carries no config: `convert_codec` matches its tensor shapes against the presets (or takes a
config) and writes `codec_config.json` next to the converted weights (`CodecConfig.to_dict` / `from_dict`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from drama3_jax.config import TINY_BAND, ConfigError


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclasses.dataclass(frozen=True)
class CodecTransformerConfig:
    """A causal window-limited transformer (`WindowLimitedTransformer`): a position attends to itself and the
    `window - 1` positions before it. `block_size` is only the length of the RoPE/mask buffers Fish stores in
    codec.pth (our RoPE is computed for any position); it is kept so the random writer reproduces the file."""

    n_layer: int
    dim: int
    n_head: int
    head_dim: int
    intermediate_size: int
    window: int
    block_size: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    def validate(self, where: str) -> None:
        _require(self.n_layer >= 1 and self.window >= 1, f"{where}: n_layer and window must be >= 1")
        _require(self.head_dim % 2 == 0, f"{where}: head_dim must be even (RoPE on pairs)")


@dataclasses.dataclass(frozen=True)
class CodecConfig:
    """All sizes of the codec. Time rates: audio at `sample_rate`; encoder latent at sample_rate / hop_length;
    codes (frames) at sample_rate / frame_length."""

    encoder_dim: int
    encoder_rates: tuple[int, ...]
    encoder_transformer: CodecTransformerConfig  # after the last encoder block (dim = latent_dim)
    latent_dim: int
    downsample_factors: tuple[int, ...]  # quantizer down/upsampling between the latent and the frame rate
    quantizer_transformer: CodecTransformerConfig  # `pre_module` (encode) and `post_module` (decode)
    semantic_codebook_size: int
    codebook_size: int  # each residual codebook
    n_residual_codebooks: int
    codebook_dim: int
    decoder_dim: int
    decoder_rates: tuple[int, ...]
    sample_rate: int = 44100
    name: str = "modded-dac"

    @property
    def hop_length(self) -> int:
        return math.prod(self.encoder_rates)

    @property
    def frame_length(self) -> int:
        """Audio samples per code frame (2048 for the real codec)."""
        return self.hop_length * math.prod(self.downsample_factors)

    @property
    def n_codebooks(self) -> int:
        return 1 + self.n_residual_codebooks

    @property
    def codebook_sizes(self) -> tuple[int, ...]:
        return (self.semantic_codebook_size,) + (self.codebook_size,) * self.n_residual_codebooks

    @property
    def encoder_dims(self) -> tuple[int, ...]:
        """Output channels of each encoder block (the input conv gives `encoder_dim`)."""
        return tuple(self.encoder_dim * 2 ** (i + 1) for i in range(len(self.encoder_rates)))

    @property
    def decoder_dims(self) -> tuple[int, ...]:
        """Channels after the decoder's input conv, then after each decoder block."""
        return tuple(self.decoder_dim // 2 ** i for i in range(len(self.decoder_rates) + 1))

    def validate(self) -> CodecConfig:
        self.encoder_transformer.validate("encoder_transformer")
        self.quantizer_transformer.validate("quantizer_transformer")
        _require(self.encoder_dims[-1] == self.encoder_transformer.dim,
                 f"encoder_transformer.dim {self.encoder_transformer.dim} must equal the last encoder block's "
                 f"channels {self.encoder_dims[-1]}")
        _require(self.quantizer_transformer.dim == self.latent_dim,
                 "quantizer_transformer.dim must equal latent_dim (Fish uses identity in/out projections)")
        _require(math.prod(self.decoder_rates) * math.prod(self.downsample_factors) == self.frame_length,
                 "decoder_rates x downsample_factors must upsample one frame to frame_length samples")
        _require(self.decoder_dim % 2 ** len(self.decoder_rates) == 0,
                 "decoder_dim must halve evenly through every decoder block")
        _require(min(self.codebook_sizes) >= 2 and self.codebook_dim >= 1, "codebooks must have >= 2 entries")
        _require(self.n_residual_codebooks >= 1, "n_residual_codebooks must be >= 1")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CodecConfig:
        d = dict(d)
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        _require(not unknown, f"codec config: unknown key(s) {unknown}")
        try:
            for key in ("encoder_transformer", "quantizer_transformer"):
                d[key] = CodecTransformerConfig(**d[key])
            for key in ("encoder_rates", "downsample_factors", "decoder_rates"):
                d[key] = tuple(int(r) for r in d[key])
            return cls(**d).validate()
        except TypeError as e:
            raise ConfigError(f"codec config: {e}") from None


def full_codec_config() -> CodecConfig:
    """The S2-Pro / Drama 3 codec (fish-speech modded_dac_vq.yaml; 391.4M parameters).

    The encoder transformer's window (512) and FFN width (3 x dim) come from fish-speech modded_dac.py
    `EncoderBlock`, which hardcodes them; heads = dim // 64 there too."""
    return CodecConfig(
        encoder_dim=64, encoder_rates=(2, 4, 8, 8),
        encoder_transformer=CodecTransformerConfig(n_layer=4, dim=1024, n_head=16, head_dim=64,
                                                   intermediate_size=3072, window=512, block_size=16384),
        latent_dim=1024, downsample_factors=(2, 2),
        quantizer_transformer=CodecTransformerConfig(n_layer=8, dim=1024, n_head=16, head_dim=64,
                                                     intermediate_size=3072, window=128, block_size=4096),
        semantic_codebook_size=4096, codebook_size=1024, n_residual_codebooks=9, codebook_dim=8,
        decoder_dim=1536, decoder_rates=(8, 8, 4, 2), name="modded-dac").validate()


def tiny_codec_config() -> CodecConfig:
    """Same structure and time rates (44.1 kHz, 2048 samples per frame, 10 codebooks) at toy widths. The semantic
    codebook equals the tiny model's tower vocabulary (`TINY_BAND`); windows are small so short clips cross them."""
    return CodecConfig(
        encoder_dim=8, encoder_rates=(2, 4, 8, 8),
        encoder_transformer=CodecTransformerConfig(n_layer=1, dim=128, n_head=2, head_dim=64,
                                                   intermediate_size=384, window=32, block_size=2048),
        latent_dim=128, downsample_factors=(2, 2),
        quantizer_transformer=CodecTransformerConfig(n_layer=2, dim=128, n_head=2, head_dim=64,
                                                     intermediate_size=384, window=8, block_size=512),
        semantic_codebook_size=TINY_BAND, codebook_size=48, n_residual_codebooks=9, codebook_dim=8,
        decoder_dim=64, decoder_rates=(8, 8, 4, 2), name="modded-dac-tiny-random").validate()


CODEC_PRESETS = {"full": full_codec_config, "tiny": tiny_codec_config}


def codec_preset(name: str) -> CodecConfig:
    if name not in CODEC_PRESETS:
        raise ConfigError(f"unknown codec preset {name!r}; choose one of {sorted(CODEC_PRESETS)}")
    return CODEC_PRESETS[name]()
