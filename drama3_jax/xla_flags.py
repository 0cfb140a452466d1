"""XLA flags the server and the experiments run with unless `XLA_FLAGS` already sets them.

`xla_gpu_command_buffer_scheduling_mode=CONCURRENT`: XLA records each executable's kernels into CUDA graphs. Its
default mode (`LHS`) chains them in one serial order, while `CONCURRENT` gives the graph only the true data
dependencies, so small independent kernels of a layer can overlap. On the H200 the full-size decode step at 128 slots
took 17.04 / 17.10 ms against 17.69 / 17.57 ms with the default, in two calls with the two orders swapped. The
3,072-row prefill call (70.45 vs 69.85 ms) and the 128 x 8 codec call (31.55 vs 31.30 ms) did not change beyond
their spread (experiments/results/ab_2026-12-04/scheduling/). XLA warns that the mode can raise peak memory, since
buffer assignment then packs fewer temporaries; neither call ran short of memory. `XLA_FLAGS=
--xla_gpu_command_buffer_scheduling_mode=LHS` restores XLA's default. The flag is a GPU option: CPU runs ignore it.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

DEFAULT_XLA_FLAGS: tuple[tuple[str, str], ...] = (("xla_gpu_command_buffer_scheduling_mode", "CONCURRENT"),)


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
