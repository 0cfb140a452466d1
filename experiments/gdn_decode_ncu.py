"""Drive GDN decode kernel variants for Nsight Compute: each variant runs `--calls` times at one shape, in the order
given, so `ncu -k regex:gdn_decode` reports them in that order (the log names each one before its launches).

  ncu --clock-control none -k regex:gdn_decode --section SpeedOfLight --section Occupancy --section LaunchStats \
      --section WarpStateStats python experiments/gdn_decode_ncu.py --variants triton,vmajor_bv32_w1 --streams 128
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.gdn_bench import CONV, D, DECODE_VARIANTS, HK, HV, KC, gates_params  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="triton")
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--state", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--also-slots", action="store_true",
                    help="after each variant, run it again with explicit slots (arange: the slot indirection path)")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from kernels.gdn import pallas_triton

    B, sdt = args.streams, jnp.dtype(args.state)
    ks = jax.random.split(jax.random.PRNGKey(5), 6)
    w, A_log, dt_bias = gates_params(jax, jnp, ks[0])
    x = jax.random.normal(ks[1], (B, CONV), jnp.bfloat16)
    a = jax.random.normal(ks[2], (B, HV), jnp.bfloat16)
    b = jax.random.normal(ks[3], (B, HV), jnp.bfloat16)
    runs = [(n, False) for n in args.variants.split(",")]
    if args.also_slots:
        runs = [r for n, _ in runs for r in ((n, False), (n, True))]
    for name, with_slots in runs:
        vk = DECODE_VARIANTS[name]
        slots = jnp.arange(B, dtype=jnp.int32) if with_slots else None
        f = jax.jit(lambda *A: pallas_triton.gdn_decode_step_triton(*A, num_k_heads=HK, head_k_dim=D, head_v_dim=D,
                                                                     slots=slots, **vk), donate_argnums=(3, 4))
        conv = jax.random.normal(ks[4], (B, KC - 1, CONV), jnp.bfloat16)
        ssm = (jax.random.normal(ks[5], (B, HV, D, D)) * 0.1).astype(sdt)
        print(f"=== variant {name} {vk} slots={'arange' if with_slots else None}: {args.calls} launches follow",
              flush=True)
        for _ in range(args.calls):
            o, conv, ssm = f(x, a, b, conv, ssm, w, A_log, dt_bias)
            jax.block_until_ready(o)


if __name__ == "__main__":
    main()
