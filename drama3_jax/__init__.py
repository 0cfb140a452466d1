"""drama3-jax: Fish Audio Drama 3 text-to-speech in JAX/Flax.

    tts = drama3_jax.load("converted_dir")          # talker (backbone + tower), codec and tokenizer
    codes = generate(tts.talker, tts.tokenizer, "Hello!")
    audio = tts.codec.decode(codes)                  # 44.1 kHz float32
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from drama3_jax.config import Drama3Config, preset

__all__ = ["Drama3", "Drama3Config", "preset", "load", "load_talker"]


@dataclasses.dataclass
class Drama3:
    """The three parts of a converted checkpoint: talker (`Drama3Model`), codec (`Codec`, None if the directory has
    no codec) and tokenizer (`Drama3Tokenizer`, None without tokenizer.json)."""

    talker: object
    codec: object
    tokenizer: object

    @property
    def cfg(self) -> Drama3Config:
        return self.talker.cfg


def load_talker(path, *, dtype=None):
    """Restore the talker (backbone + tower) of a converted checkpoint directory."""
    from drama3_jax.checkpoint import load_model

    return load_model(path, dtype=dtype)


def load(path, *, dtype=None, codec_dtype=None) -> Drama3:
    """Restore everything a converted directory holds (see `scripts/convert_checkpoint.py`)."""
    from drama3_jax.codec import Codec, load_codec
    from drama3_jax.codec.convert import CONFIG_FILE
    from drama3_jax.tokenizer import load_tokenizer

    path = Path(path)
    talker = load_talker(path, dtype=dtype)
    codec = Codec(load_codec(path, dtype=codec_dtype)) if (path / CONFIG_FILE).exists() else None
    tok = load_tokenizer(path, talker.cfg) if (path / "tokenizer.json").exists() else None
    return Drama3(talker, codec, tok)
