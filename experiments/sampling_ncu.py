"""Drive the sampling kernels for Nsight Compute: one decode step's 10 samplings as frame_step issues them (main token
+ 9 head launches), on sampling_bench's inputs, `--calls` times per tuning variant in the order given; the log names
each variant before its launches, so `ncu -k regex:sample_` reports them in that order.

  ncu --clock-control none -k regex:sample_ --section SpeedOfLight --section LaunchStats --section Occupancy \
      --section WarpStateStats --section InstructionStats python experiments/sampling_ncu.py --streams 128 \
      --variants '{}' '{"rows": {"num_warps": 16}}'
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.sampling_bench import build, make_inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=["{}"],
                    help='tuning overrides per variant as JSON, e.g. \'{"rows": {"num_warps": 16}}\'')
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    inp = make_inputs(jax, jnp, np, args.streams, seed=5000 + args.streams)
    for spec in args.variants:
        kw = json.loads(spec)
        step = jax.jit(build(jax, jnp, "per_head", **kw))
        jax.block_until_ready(step(inp, 0))        # compile outside the launches that follow
        print(f"=== variant {kw}: {args.calls} steps of 10 launches follow", flush=True)
        for f in range(args.calls):
            jax.block_until_ready(step(inp, 1 + f))


if __name__ == "__main__":
    main()
