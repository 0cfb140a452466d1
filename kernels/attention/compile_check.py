"""Compile the decode attention kernel for sm_90 on a machine without a GPU: lower through Pallas (Triton dialect)
for an abstract H200, then run the `triton` package's compiler (TTIR -> PTX, its bundled ptxas for the resource
report). Catches what interpret mode cannot: lowering-type bugs, Triton verification errors, registers, spills,
shared memory. The pip `triton` here is not the one inside the H200's jaxlib: a pass is a strong hint, not a proof.

  python -m kernels.attention.compile_check [--batch 128] [--set block_k=64 --set num_warps=4 ...]
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

HQ, HKV, D, L = 16, 2, 256, 4100  # Drama 3 backbone / tower attention, serving cache length


def lower_ttir(B: int = 128, **tuning) -> tuple[str, int, int]:
    """(Triton-dialect module text, num_warps, num_stages) of the decode kernel at Drama 3 shapes, bf16 cache."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    from kernels.attention import pallas_triton as PT

    captured = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        r = orig(*a, **k)
        captured.append(r.module.operation.get_asm(enable_debug_info=False))
        return r

    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=dev)
    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        with jax.sharding.use_abstract_mesh(mesh):
            fn = functools.partial(PT.decode_attention_triton, scale=D ** -0.5, **tuning)
            jax.jit(fn).trace(sd((B, HQ, D), bf), sd((B, L, HKV, D), bf), sd((B, L, HKV, D), bf),
                              sd((B,), jnp.int32)).lower(lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig
    p = PT._params(tuning)
    return captured[-1], p["num_warps"], p["num_stages"]


def compile_ptx(ttir: str, num_warps: int, num_stages: int) -> dict:
    """Triton TTIR -> PTX -> cubin for sm_90a; compile time, registers, spills, shared memory, mma count."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.ttir")
        with open(path, "w") as f:
            f.write(ttir)
        t = time.time()
        c = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps, "num_stages": num_stages})
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
                mma=len(re.findall(r"\bw?mma", ptx)), cp_async=ptx.count("cp.async"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--set", action="append", default=[], help="tuning override, e.g. block_k=128")
    a = ap.parse_args(argv)
    tuning = {k: int(v) for k, v in (s.split("=") for s in a.set)}
    try:
        ttir, warps, stages = lower_ttir(a.batch, **tuning)
        print(tuning, compile_ptx(ttir, warps, stages), flush=True)
    except Exception as e:  # noqa: BLE001  (report, exit non-zero)
        print(tuning, "FAILED", type(e).__name__, str(e)[:2000], flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
