"""ModifiedDAC codec (Fish S2-Pro / Drama 3): 10 codebooks, 44.1 kHz, 2048 samples per frame.

    from drama3_jax.codec import Codec, load_codec
    codec = Codec(load_codec(ckpt_dir))             # fp32; load_codec(ckpt_dir, dtype=jnp.bfloat16) for serving
    codes = codec.encode(samples, sample_rate)      # [10, T] int32
    audio = codec.decode(codes)                     # [T * 2048] float32
    state = codec.init_state(streams); audio, state = codec.step(state, new_codes)   # exact streaming

Files: config.py (full/tiny presets), layers.py + transformer.py + model.py (Flax NNX modules), streaming.py (jitted
host API), convert.py (codec.pth <-> Orbax, random writer), torch_pickle.py (torch-free .pth reader), audio_io.py,
__main__.py (CLI).
"""

from drama3_jax.codec.config import CodecConfig, codec_preset, full_codec_config, tiny_codec_config
from drama3_jax.codec.convert import convert_codec, load_codec, random_codec, write_random_codec_pth
from drama3_jax.codec.model import DecodeState, ModifiedDAC
from drama3_jax.codec.streaming import Codec, validate_codes

__all__ = ["CodecConfig", "codec_preset", "full_codec_config", "tiny_codec_config", "convert_codec", "load_codec",
           "random_codec", "write_random_codec_pth", "DecodeState", "ModifiedDAC", "Codec", "validate_codes"]
