"""Drive the sampling kernels for Nsight Compute: the main-token launch and one codebook-head launch, as frame_step
issues them, on the bench's model-faithful inputs (`sampling_bench.make_inputs`), each compiled first and then run
`--calls` times, so `ncu -k regex:sample_` reports the timed launches after the compile call's (the log names each).

  ncu --clock-control none -k regex:sample_ --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats --section SchedulerStats python experiments/sampling_ncu.py --streams 128
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.sampling_bench import EOS, SEM_START, make_inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a CPU check of this script)")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from drama3_jax import sampling as S

    B = args.streams
    inp = make_inputs(jax, jnp, np, B, seed=5000 + B)
    fkeys = S.frame_keys(inp["req"], jnp.full((B,), 3, jnp.int32))
    T, P, K = inp["temperature"], inp["top_p"], inp["top_k"]
    kw = {"interpret": True} if args.interpret else {}
    runs = {
        "main": jax.jit(lambda: S.sample_main(fkeys, inp["main"], T, P, K, inp["recent"], semantic_start=SEM_START,
                                              eos_token_id=EOS, backend="pallas_triton", **kw)),
        "head 0": jax.jit(lambda: S.sample_head(fkeys, 0, inp["head_rows"][0], T, P, K, backend="pallas_triton",
                                                **kw)),
    }
    for name, fn in runs.items():
        jax.block_until_ready(fn())
        print(f"run {name} B={B} calls={args.calls}", flush=True)
        for _ in range(args.calls):
            jax.block_until_ready(fn())


if __name__ == "__main__":
    main()
