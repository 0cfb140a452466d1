"""Compile an attention kernel for sm_90 on a machine without a GPU (kernels/h200_lowering.py says how and what
that proves): registers, spills, shared memory, tensor-core and cp.async instruction counts.

  python -m kernels.attention.compile_check [--kernel decode|prefill] [--batch 128] [--set block_k=64 ...]

decode: one query per stream over a 4100-row cache; prefill: `--batch` lanes of 512 query rows (a packed call).
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

from kernels.h200_lowering import capture_ttir, compile_ttir

HQ, HKV, D, L = 16, 2, 256, 4100  # Drama 3 backbone / tower attention, serving cache length


def lower_ttir(B: int = 128, kernel: str = "decode", **tuning) -> tuple[str, int, int]:
    """(Triton-dialect module text, num_warps, num_stages) of the kernel at Drama 3 shapes, bf16 operands."""
    from kernels.attention import pallas_triton as PT

    sd, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    if kernel == "prefill":
        T = 512
        fn = functools.partial(PT.prefill_attention_triton, scale=D ** -0.5, **tuning)
        ttir = capture_ttir(fn, sd((B, T, HQ, D), bf), sd((B, T, HKV, D), bf), sd((B, T, HKV, D), bf),
                            sd((B, T), i32), sd((B,), i32))
        p = PT._params(tuning, PT.PREFILL_TUNING)
    else:
        fn = functools.partial(PT.decode_attention_triton, scale=D ** -0.5, **tuning)
        ttir = capture_ttir(fn, sd((B, HQ, D), bf), sd((B, L, HKV, D), bf), sd((B, L, HKV, D), bf), sd((B,), i32))
        p = PT._params(tuning)
    return ttir, p["num_warps"], p["num_stages"]


def compile_ptx(ttir: str, num_warps: int, num_stages: int) -> dict:
    """The resource report plus the PTX's tensor-core (mma/wgmma) and cp.async counts."""
    report, ptx = compile_ttir(ttir, num_warps, num_stages)
    return dict(report, mma=len(re.findall(r"\bw?mma", ptx)), cp_async=ptx.count("cp.async"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=["decode", "prefill"], default="decode")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--set", action="append", default=[], help="tuning override, e.g. block_k=128")
    a = ap.parse_args(argv)
    tuning = {k: int(v) for k, v in (s.split("=") for s in a.set)}
    try:
        ttir, warps, stages = lower_ttir(a.batch, a.kernel, **tuning)
        print(tuning, compile_ptx(ttir, warps, stages), flush=True)
    except Exception as e:  # noqa: BLE001  (report, exit non-zero)
        print(tuning, "FAILED", type(e).__name__, str(e)[:2000], flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
