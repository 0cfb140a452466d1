"""Codec command line.

    python -m drama3_jax.codec encode IN.wav --checkpoint DIR --out codes.npy     # codes [10, T] int32
    python -m drama3_jax.codec decode codes.npy --checkpoint DIR --out OUT.wav    # 44.1 kHz mono (.wav/.flac/.pcm)

DIR is a converted checkpoint directory (codec_config.json + codec/), see drama3_jax/codec/convert.py.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from drama3_jax.codec.audio_io import read_audio, write_audio
from drama3_jax.codec.convert import CodecCheckpointError, load_codec
from drama3_jax.codec.streaming import Codec
from drama3_jax.config import ConfigError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m drama3_jax.codec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    enc = sub.add_parser("encode", help="audio file (any rate / channels) -> codes .npy [codebooks, frames]")
    enc.add_argument("input")
    dec = sub.add_parser("decode", help="codes .npy [codebooks, frames] -> audio file at the codec rate")
    dec.add_argument("input")
    for p in (enc, dec):
        p.add_argument("--checkpoint", required=True, help="converted checkpoint directory")
        p.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        codec = Codec(load_codec(args.checkpoint))
        if args.command == "encode":
            audio, sr = read_audio(args.input)
            codes = codec.encode(audio, sr)
            np.save(args.out, codes)
            print(f"{args.input}: {audio.shape[0] / sr:.2f} s -> codes {codes.shape} in {args.out}")
        else:
            codes = np.load(args.input)
            if codes.ndim != 2:
                raise ValueError(f"expected codes [codebooks, frames], got shape {codes.shape}")
            audio = codec.decode(codes)
            write_audio(args.out, audio, codec.cfg.sample_rate)
            print(f"{args.input}: codes {codes.shape} -> {audio.shape[0] / codec.cfg.sample_rate:.2f} s in {args.out}")
    except (ValueError, FileNotFoundError, CodecCheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
