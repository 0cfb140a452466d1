"""Compile the sampling kernels for sm_90 on a machine without a GPU (kernels/h200_lowering.py says how and what that
proves): register use, spills, shared memory, division and barrier instruction counts.

  python -m kernels.sampling.compile_check [--kernel rows|main|both] [--set groups=64 --set cand=32 ...]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from kernels.h200_lowering import capture_ttir, compile_ttir


def lower_ttir(kind: str, B: int = 128, **tuning) -> tuple[str, int]:
    """(Triton-dialect module text, num_warps) of one sampling kernel at Drama 3 shapes."""
    from kernels.sampling import pallas_triton as PT

    sd = jax.ShapeDtypeStruct
    f32, i32, u32 = jnp.float32, jnp.int32, jnp.uint32
    # as the model calls them: the frame's keys, folded with the draw id in the kernel
    if kind == "rows":
        fn = functools.partial(PT.sample_filtered_triton, keep_crossing=False, draw=2, **tuning)
        args = (sd((B, 2), u32), sd((B, 4096), f32), sd((B,), f32), sd((B,), f32), sd((B,), i32))
    else:
        fn = lambda k, x, t, p, tk, rec: PT.sample_main_triton(
            k, None, x, t, p, tk, rec, semantic_start=151678, eos_token_id=151645, ras_temperature=1.0, ras_top_k=30,
            ras_top_p=0.95, draws=(0, 1), **tuning)
        args = (sd((B, 2), u32), sd((B, 4097), f32), sd((B,), f32), sd((B,), f32), sd((B,), i32), sd((B, 16), i32))
    table = "rows" if kind == "rows" else "main"
    return capture_ttir(fn, *args), int(tuning.get("num_warps") or PT.TUNING[table]["num_warps"])


def compile_ptx(ttir: str, num_warps: int) -> dict:
    """The resource report plus the PTX's division, barrier and warp-shuffle instruction counts."""
    report, ptx = compile_ttir(ttir, num_warps, num_stages=1)
    return dict(report, div_rn=ptx.count("div.rn.f32"), div_full=ptx.count("div.full.f32"),
                bar_sync=ptx.count("bar.sync"), shfl_sync=ptx.count("shfl.sync"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", default="both", choices=["rows", "main", "both"])
    ap.add_argument("--set", action="append", default=[], help="tuning override, e.g. groups=64")
    a = ap.parse_args(argv)
    tuning = {k: int(v) for k, v in (s.split("=") for s in a.set)}
    kinds = ["rows", "main"] if a.kernel == "both" else [a.kernel]
    ok = True
    for kind in kinds:
        try:
            ttir, warps = lower_ttir(kind, **tuning)
            print(kind, tuning, compile_ptx(ttir, warps), flush=True)
        except Exception as e:  # report and go on with the other kernel
            ok = False
            print(kind, tuning, "FAILED", type(e).__name__, str(e)[:2000], flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
