"""Check Pallas-Triton kernels for the H200 on a machine without a GPU: lower through Pallas for an abstract H200
(`lower_for_h200`, `capture_ttir`), then compile the captured Triton module with the `triton` package's compiler
(TTIR -> PTX, its bundled ptxas for the resource report: `compile_ttir`). Catches what interpret mode cannot:
lowering-type bugs, Triton verification errors, registers, spills, shared memory. The pip `triton` here is not the
one inside the H200's jaxlib: a pass is a strong hint, not a proof; the device run is the proof.

Whole programs: `compile_for_h200` runs XLA's GPU compiler for an H200 on this machine (deviceless AOT: the CUDA PJRT
plugin's topology built from a GpuTargetConfigProto, no GPU and no driver) and returns the optimized HLO, kernel by
kernel as the device would launch them. It needs the CUDA 13 plugin of the H200's jax, kept out of the project's venv
(`make deviceless` puts it in `.deviceless/`; with it installed jax would try to start CUDA in every process).
Without a device XLA cannot autotune: GEMM tilings and split-K and the cuDNN algorithms are XLA's defaults, so the
kernel list and the fusions are the device's, their tile choices may not be.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time

import jax

DEVICELESS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".deviceless")

# One H200 SXM as XLA's GPU compiler sees it (stream_executor.GpuTargetConfigProto text): NVIDIA's published figures
# (132 SMs, 50 MiB L2, 228 KiB shared memory per SM of which 227 KiB per block, 1.98 GHz boost, 141 GB HBM3e), in
# the fields of XLA's own spec file xla/backends/gpu/target_config/specs/h200.txtpb.
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152 shared_memory_per_core: 233472
  threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535 block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 151397597184 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
device_description_str: "NVIDIA H200 141GB HBM3e"
"""


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


def h200_sharding() -> jax.sharding.NamedSharding:
    """A sharding on one deviceless H200 (the CUDA PJRT plugin's topology from `H200_TARGET_CONFIG`): arguments
    carrying it make jit compile for that device on a machine without one. Raises RuntimeError naming `make
    deviceless` when the plugin is missing."""
    if os.path.isdir(DEVICELESS_DIR) and DEVICELESS_DIR not in sys.path:
        sys.path.append(DEVICELESS_DIR)
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # the plugin's driver check: there is no driver
    from jax._src import xla_bridge
    from jax.experimental import topologies
    try:
        xla_bridge._discover_and_register_pjrt_plugins()
        if "cuda" not in xla_bridge._topology_factories:  # jax looked for plugins before the path was added
            import importlib
            importlib.import_module("jax_plugins.xla_cuda13").initialize()
        topo = topologies.get_topology_desc("h200", "cuda", target_config=H200_TARGET_CONFIG, topology="1x1x1")
    except Exception as e:
        raise RuntimeError(f"no deviceless CUDA compiler ({type(e).__name__}: {str(e)[:200]}); run `make deviceless`"
                           ) from None
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


@contextlib.contextmanager
def as_if_on_gpu():
    """Make `jax.default_backend()` say "gpu" while a program is traced, so that the kernels' "auto" backends pick
    their Pallas GPU implementations (kernels/dispatch.py) and no kernel runs in interpret mode."""
    orig = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        yield
    finally:
        jax.default_backend = orig


def compile_for_h200(fn, *args, static_argnums=(), donate_argnums=()) -> str:
    """Optimized HLO text of `jax.jit(fn)(*args)` compiled for one H200 on this machine. args: arrays or
    ShapeDtypeStructs (pytrees of them; only shapes and dtypes are used) and the static arguments."""
    s = h200_sharding()
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) if hasattr(x, "dtype") else x
    args = [a if i in static_argnums else jax.tree.map(place, a) for i, a in enumerate(args)]
    with as_if_on_gpu(), h200_mesh():  # the mesh: Pallas-Triton lowering reads the device kind from it
        # a new callable each time: jit's trace cache is keyed on it, and a patched module constant must be re-read
        jitted = jax.jit(lambda *a: fn(*a), static_argnums=static_argnums, donate_argnums=donate_argnums)
        return jitted.lower(*args).compile().as_text()
