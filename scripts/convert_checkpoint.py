"""Convert a Drama 3 HF checkpoint (safetensors, block-FP8 experts) to the Orbax layout `drama3_jax.load` reads.

    python -m scripts.convert_checkpoint --hf-dir DIR --out DIR [--codec codec.pth] [--experts fp8|bf16]

The codec (Fish's S2-Pro codec.pth) is taken from --codec, else from DIR/codec.pth when present.

Tensors are streamed one at a time and written one layer at a time, so memory stays near one layer's size.
"""

from __future__ import annotations

import argparse
import sys
import time

from drama3_jax.checkpoint import CheckpointError, convert
from drama3_jax.codec.convert import CodecCheckpointError
from drama3_jax.config import ConfigError


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", required=True, help="directory with config.json and the safetensors shards")
    ap.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    ap.add_argument("--experts", default="fp8", choices=["fp8", "bf16"],
                    help="keep routed experts as FP8 + block scales, or dequantise them to bf16")
    ap.add_argument("--codec", default=None, help="Fish's codec.pth (default: HF_DIR/codec.pth if present)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        stats = convert(args.hf_dir, args.out, experts=args.experts, codec=args.codec)
    except (CheckpointError, CodecCheckpointError, ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"converted {stats.tensors} tensors in {stats.groups} groups to {args.out} "
          f"({time.perf_counter() - t0:.1f} s, largest group {stats.peak_group_bytes / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
