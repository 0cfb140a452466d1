"""drama3_jax/xla_flags.py: the default XLA flags are added to XLA_FLAGS unless it names them itself."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from drama3_jax.xla_flags import DEFAULT_XLA_FLAGS, apply_default_xla_flags, with_default_xla_flags

MODE = "--xla_gpu_command_buffer_scheduling_mode"


def test_defaults_are_added_and_the_users_flags_win():
    assert DEFAULT_XLA_FLAGS == (("xla_gpu_command_buffer_scheduling_mode", "CONCURRENT"),)
    assert with_default_xla_flags("") == f"{MODE}=CONCURRENT"
    assert with_default_xla_flags(" --xla_gpu_enable_command_buffer= ") == \
        f"--xla_gpu_enable_command_buffer= {MODE}=CONCURRENT"
    assert with_default_xla_flags(f"{MODE}=LHS --xla_dump_to=xla_dump") == f"{MODE}=LHS --xla_dump_to=xla_dump"
    once = with_default_xla_flags("--xla_dump_to=xla_dump")
    assert with_default_xla_flags(once) == once  # idempotent


def test_apply_sets_the_environment(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=xla_dump")
    assert apply_default_xla_flags() == f"--xla_dump_to=xla_dump {MODE}=CONCURRENT"
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=xla_dump {MODE}=CONCURRENT"
    monkeypatch.setenv("XLA_FLAGS", f"{MODE}=SERIALIZE")
    assert apply_default_xla_flags() == f"{MODE}=SERIALIZE"


def test_experiment_scripts_apply_them_before_jax_starts():
    """Importing an experiment script (which imports experiments.common first) sets the flags while no backend has
    started, and a CPU computation runs under them."""
    code = ("import experiments.decode_profile, os\n"
            "from jax._src import xla_bridge\n"
            "assert not xla_bridge.backends_are_initialized()\n"
            "import jax.numpy as jnp\n"
            "assert float(jnp.arange(4.0).sum()) == 6.0\n"
            "print(os.environ['XLA_FLAGS'])\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"{MODE}=CONCURRENT"


def test_gpu_memory_fraction_flag_then_environment_then_default(monkeypatch):
    from drama3_jax.xla_flags import (DEFAULT_GPU_MEMORY_FRACTION, MEM_FRACTION_ENV, apply_gpu_memory_fraction,
                                      gpu_memory_fraction)

    assert gpu_memory_fraction(None, {}) == str(DEFAULT_GPU_MEMORY_FRACTION) == "0.92"
    assert gpu_memory_fraction(None, {MEM_FRACTION_ENV: ".8"}) == ".8"
    assert gpu_memory_fraction(0.5, {MEM_FRACTION_ENV: ".8"}) == "0.5"
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="in \\(0, 1\\]"):
            gpu_memory_fraction(bad, {})
    with pytest.raises(ValueError, match="'most'"):
        gpu_memory_fraction(None, {MEM_FRACTION_ENV: "most"})
    monkeypatch.delenv(MEM_FRACTION_ENV, raising=False)
    assert apply_gpu_memory_fraction(0.6) == "0.6" == os.environ[MEM_FRACTION_ENV]
