"""Compile the sampling kernels for sm_90 on a machine without a GPU: lower through Pallas (Triton dialect) for an
abstract H200, then run the `triton` package's compiler (TTIR -> PTX, its bundled ptxas for the resource report).
Catches what interpret mode cannot: lowering-type bugs, Triton verification errors, register use and spills.

The Triton here (the pip package pulled in by torch) is not the one inside the H200's jaxlib, so a pass here is a
strong hint, not a proof; the device run is the proof.

  python -m kernels.sampling.compile_check [--kernel rows|main|both] [--set groups=64 --set cand=32 ...]
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp


def lower_ttir(kind: str, B: int = 128, **tuning) -> tuple[str, int]:
    """(Triton-dialect module text, num_warps) of one sampling kernel at Drama 3 shapes."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    from kernels.sampling import pallas_triton as PT

    captured = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        r = orig(*a, **k)
        captured.append(r.module.operation.get_asm(enable_debug_info=False))
        return r

    sd = jax.ShapeDtypeStruct
    f32, i32, u32 = jnp.float32, jnp.int32, jnp.uint32
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=dev)
    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            if kind == "rows":
                R = B * 9
                fn = functools.partial(PT.sample_filtered_triton, keep_crossing=False, **tuning)
                args = (sd((R, 2), u32), sd((R, 4096), f32), sd((R,), f32), sd((R,), f32), sd((R,), i32))
            else:
                fn = functools.partial(PT.sample_main_triton, semantic_start=151678, eos_token_id=151645,
                                       ras_temperature=1.0, ras_top_k=30, ras_top_p=0.95, **tuning)
                args = (sd((B, 2), u32), sd((B, 2), u32), sd((B, 4097), f32), sd((B,), f32), sd((B,), f32),
                        sd((B,), i32), sd((B, 16), i32))
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig
    table = "rows" if kind == "rows" else "main"
    return captured[-1], int(tuning.get("num_warps") or PT.TUNING[table]["num_warps"])


def compile_ptx(ttir: str, num_warps: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        t = time.time()
        c = triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 1})
        secs = time.time() - t
        ptx = c.asm["ptx"]
        ptx_path = os.path.join(d, "kernel.ptx")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        rep = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx_path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", rep)
    spill = re.search(r"(\d+) bytes spill stores", rep)
    return dict(compile_s=round(secs, 1), registers=int(regs.group(1)) if regs else None,
                spill_bytes=int(spill.group(1)) if spill else None, shared_bytes=c.metadata.shared,
                div_rn=ptx.count("div.rn.f32"), div_full=ptx.count("div.full.f32"), bar_sync=ptx.count("bar.sync"))


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
