"""Write a random checkpoint in the exact HF layout of fishaudio/drama-3 (sharded safetensors + index + config).

    python -m scripts.make_tiny_checkpoint --out DIR [--preset tiny] [--seed 0] [--shard-mb 0.25] [--no-codec]

Writes config.json, model-0000N-of-0000M.safetensors + index (bf16, FP8 experts with fp32 block scales),
tokenizer.json (tiny preset) and a random codec.pth in Fish's key layout (needs torch, a dev dependency).
"""

from __future__ import annotations

import argparse

from drama3_jax.checkpoint import write_random_checkpoint
from drama3_jax.codec import codec_preset
from drama3_jax.config import preset


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "full"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-mb", type=float, default=0.25, help="maximum shard size in MiB")
    ap.add_argument("--no-codec", action="store_true", help="do not write codec.pth")
    args = ap.parse_args(argv)
    codec_cfg = None if args.no_codec else codec_preset(args.preset)
    out = write_random_checkpoint(preset(args.preset), args.out, seed=args.seed,
                                  shard_bytes=int(args.shard_mb * (1 << 20)), tokenizer=args.preset == "tiny",
                                  codec_cfg=codec_cfg)
    print(f"wrote {args.preset} random checkpoint (seed {args.seed}) to {out}")


if __name__ == "__main__":
    main()
