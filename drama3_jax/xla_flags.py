"""XLA flags the server and the experiments run with unless `XLA_FLAGS` already sets them.

`xla_gpu_command_buffer_scheduling_mode=CONCURRENT`: XLA records each executable's kernels into CUDA graphs. Its
default mode (`LHS`) chains them in one serial order, while `CONCURRENT` gives the graph only the true data
dependencies, so small independent kernels of a layer can overlap. On the H200 the full-size decode step at 128 slots
took 17.04 / 17.10 ms against 17.69 / 17.57 ms with the default, in two calls with the two orders swapped. The
3,072-row prefill call (70.45 vs 69.85 ms) and the 128 x 8 codec call (31.55 vs 31.30 ms) did not change beyond
their spread (experiments/results/ab_2026-12-04/scheduling/). XLA warns that the mode can raise peak memory, since
buffer assignment then packs fewer temporaries; neither call ran short of memory. `XLA_FLAGS=
--xla_gpu_command_buffer_scheduling_mode=LHS` restores XLA's default. The flag is a GPU option: CPU runs ignore it.

GPU memory: JAX reserves `XLA_PYTHON_CLIENT_MEM_FRACTION` of the GPU's memory at start-up (0.75 unless set). The
server takes DEFAULT_GPU_MEMORY_FRACTION instead (`--gpu-memory-fraction`): with 0.75 on an 80 GB H100 the full-size
model (36.9 GiB of weights) at 128 streams with 512 prompt + 512 new rows ran out of memory in its warm-up
(experiments/results/serve_bench_21_h100/), while the same configuration fits on the H200's 141 GB.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

DEFAULT_XLA_FLAGS: tuple[tuple[str, str], ...] = (("xla_gpu_command_buffer_scheduling_mode", "CONCURRENT"),)
DEFAULT_GPU_MEMORY_FRACTION = 0.92   # of the GPU's memory; the rest stays free for the CUDA context and cuDNN
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def with_default_xla_flags(flags: str) -> str:
    """`flags` (an XLA_FLAGS value) plus every DEFAULT_XLA_FLAGS entry it does not name itself."""
    given = {f.split("=", 1)[0].lstrip("-") for f in flags.split()}
    extra = [f"--{name}={value}" for name, value in DEFAULT_XLA_FLAGS if name not in given]
    return " ".join([flags.strip()] + extra).strip()


def apply_default_xla_flags() -> str:
    """Set os.environ["XLA_FLAGS"] to `with_default_xla_flags` of its current value and return it. XLA reads the
    variable when JAX starts its backends, so call this before the first array or device query; later it only
    logs a warning."""
    from jax._src import xla_bridge

    flags = with_default_xla_flags(os.environ.get("XLA_FLAGS", ""))
    if flags != os.environ.get("XLA_FLAGS", "") and xla_bridge.backends_are_initialized():
        log.warning("JAX backends already started: the default XLA flags (%s) do not apply to this process", flags)
    os.environ["XLA_FLAGS"] = flags
    return flags


def gpu_memory_fraction(requested: float | None, env: dict) -> str:
    """The XLA_PYTHON_CLIENT_MEM_FRACTION value to run with: `requested` (a flag) when given, else the environment's
    own value, else DEFAULT_GPU_MEMORY_FRACTION. Raises ValueError outside (0, 1]."""
    value = str(requested) if requested is not None else env.get(MEM_FRACTION_ENV, str(DEFAULT_GPU_MEMORY_FRACTION))
    try:
        ok = 0.0 < float(value) <= 1.0
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"the GPU memory fraction must be a number in (0, 1], got {value!r}")
    return value


def apply_gpu_memory_fraction(requested: float | None = None) -> str:
    """Set os.environ[XLA_PYTHON_CLIENT_MEM_FRACTION] to `gpu_memory_fraction` and return it; like the XLA flags it
    must be set before JAX starts its backends."""
    from jax._src import xla_bridge

    value = gpu_memory_fraction(requested, os.environ)
    if value != os.environ.get(MEM_FRACTION_ENV) and xla_bridge.backends_are_initialized():
        log.warning("JAX backends already started: the GPU memory fraction %s does not apply to this process", value)
    os.environ[MEM_FRACTION_ENV] = value
    return value
