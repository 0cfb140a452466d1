"""Drive the GDN prefill kernels (ours, then FLA's) for Nsight Compute: each of our variants runs `--calls` times at
each shape, in the order given, then FLA's `chunk_gated_delta_rule` once per shape (with `--fla`), so `ncu` reports
the launches in that order (the log names each run before its launches).

  ncu --clock-control none -k regex:gdn_prefill --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats python experiments/gdn_prefill_ncu.py --shapes 1x4096 --variants triton,triton_inv2
  ncu --clock-control none --nvtx --nvtx-include fla/ --section SpeedOfLight ... \
      python experiments/gdn_prefill_ncu.py --shapes 1x4096 --variants "" --fla
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.gdn_bench import PREFILL_VARIANTS, prefill_inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x4096", help="comma-separated BxT")
    ap.add_argument("--variants", default="triton", help="comma-separated names of gdn_bench.PREFILL_VARIANTS")
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--fla", action="store_true", help="then FLA's chunk_gated_delta_rule once per shape")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from kernels.gdn import pallas_triton

    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    inputs = {s: prefill_inputs(jax, jnp, *s) for s in shapes}
    for name in filter(None, args.variants.split(",")):
        fn = jax.jit(lambda *a, kw=PREFILL_VARIANTS[name]: pallas_triton.gated_delta_chunk_prefill_triton(*a, **kw))
        for B, T in shapes:
            jax.block_until_ready(fn(*inputs[B, T]))  # compile outside the reported launches' order
            print(f"run ours {name} B={B} T={T} calls={args.calls}", flush=True)
            for _ in range(args.calls):
                jax.block_until_ready(fn(*inputs[B, T]))
    if args.fla:
        import numpy as np
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        for B, T in shapes:
            q, k, v, g, beta, s0 = (torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda() for x in inputs[B, T])
            q, k, v, beta = (x.to(torch.bfloat16).contiguous() for x in (q, k, v, beta))
            run = lambda: chunk_gated_delta_rule(q, k, v, g.contiguous(), beta, initial_state=s0,
                                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
            run()  # FLA's autotuning launches; profile under `ncu --nvtx --nvtx-include fla/` to leave them out
            torch.cuda.synchronize()
            print(f"run fla B={B} T={T}", flush=True)
            torch.cuda.nvtx.range_push("fla")
            run()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
