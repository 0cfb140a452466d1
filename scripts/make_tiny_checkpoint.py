"""Write a random checkpoint in the exact HF layout of fishaudio/drama-3 (sharded safetensors + index + config).

    python -m scripts.make_tiny_checkpoint --out DIR [--preset tiny] [--seed 0] [--shard-mb 2]
"""

from __future__ import annotations

import argparse

from drama3_jax.checkpoint import write_random_checkpoint
from drama3_jax.config import preset


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "full"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-mb", type=float, default=0.25, help="maximum shard size in MiB")
    args = ap.parse_args(argv)
    out = write_random_checkpoint(preset(args.preset), args.out, seed=args.seed,
                                  shard_bytes=int(args.shard_mb * (1 << 20)))
    print(f"wrote {args.preset} random checkpoint (seed {args.seed}) to {out}")


if __name__ == "__main__":
    main()
