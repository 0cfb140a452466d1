"""Check Pallas-Triton kernels for the H200 on a machine without a GPU: lower through Pallas for an abstract H200
(`lower_for_h200`, `capture_ttir`), then compile the captured Triton module with the `triton` package's compiler
(TTIR -> PTX, its bundled ptxas for the resource report: `compile_ttir`). Catches what interpret mode cannot:
lowering-type bugs, Triton verification errors, registers, spills, shared memory. The pip `triton` here is not the
one inside the H200's jaxlib: a pass is a strong hint, not a proof; the device run is the proof.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time

import jax


def h200_mesh():
    """A context in which jit lowers for one abstract NVIDIA H200 (132 SMs)."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=dev)
    return jax.sharding.use_abstract_mesh(mesh)


def lower_for_h200(fn, *args, donate=()) -> str:
    """StableHLO text of `jax.jit(fn, donate_argnums=donate)` lowered for CUDA on an abstract H200."""
    with h200_mesh():
        return jax.jit(fn, donate_argnums=donate).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def capture_ttirs(fn, *args) -> list[str]:
    """Triton-dialect module texts of every Pallas kernel that lowering `fn(*args)` for an H200 produces, in order."""
    from jax._src.pallas.triton import pallas_call_registration as reg

    captured = []
    orig = reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        r = orig(*a, **k)
        captured.append(r.module.operation.get_asm(enable_debug_info=False))
        return r

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        lower_for_h200(fn, *args)
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = orig
    return captured


def capture_ttir(fn, *args) -> str:
    """Triton-dialect module text of the last Pallas kernel that lowering `fn(*args)` for an H200 produces."""
    return capture_ttirs(fn, *args)[-1]


def compile_ttir(ttir: str, num_warps: int, num_stages: int) -> tuple[dict, str]:
    """Triton TTIR -> PTX -> cubin for sm_90a. Returns (compile seconds, registers, spill and shared bytes; the PTX)."""
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
                spill_bytes=int(spill.group(1)) if spill else None, shared_bytes=c.metadata.shared), ptx
