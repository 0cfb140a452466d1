"""ModifiedDAC codec (Fish S2-Pro / Drama 3): 10 codebooks at 44.1 kHz / 2048 samples per frame.

    from drama3_jax.codec import load_codec, StreamingDecoder
    codec = load_codec(converted_dir)                 # fp32; dtype=jnp.bfloat16 for serving
    audio = decode(codec, codes)                      # codes [B, 10, T] -> [B, T * 2048]
"""

from drama3_jax.codec.config import CodecConfig, codec_preset, full_codec_config, tiny_codec_config
from drama3_jax.codec.convert import convert_codec, load_codec, write_random_codec_pth
from drama3_jax.codec.model import DecodeState, ModifiedDAC

__all__ = ["CodecConfig", "codec_preset", "full_codec_config", "tiny_codec_config", "convert_codec", "load_codec",
           "write_random_codec_pth", "DecodeState", "ModifiedDAC"]
