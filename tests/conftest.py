"""Shared fixtures: a tiny random checkpoint in the real HF layout, converted once per session."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One XLA compilation cache inside the checkout, shared by both xdist workers and the servers and CLIs the tests start
# (they inherit the environment), so no test writes to the user's ~/.cache. On a cold clean clone it did not shorten
# the suite (23.9 vs 23.7 min: the tests compile few identical executables); it only speeds up repeated local runs
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "xla"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.3")

import numpy as np
import pytest

from drama3_jax.checkpoint import convert, write_random_checkpoint
from drama3_jax.config import tiny_config


# Test files that share tests/serving/conftest.py's session-scoped live server: one xdist work unit, so that one worker
# starts the server once (each start compiles the tiny model's shapes: 15-56 s on a 2-core machine, busy or not)
ONE_SERVER = ("tests/serving/test_server.py", "tests/serving/test_bench.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` (the README's test command), with the ONE_SERVER files as one unit; else xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class OneServerLoadFile(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return ONE_SERVER[0] if path in ONE_SERVER else path

    return OneServerLoadFile(config, log)


@pytest.fixture(scope="session")
def tiny_cfg():
    return tiny_config()


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory, tiny_cfg):
    return write_random_checkpoint(tiny_cfg, tmp_path_factory.mktemp("tiny_hf"), seed=1234)


@pytest.fixture(scope="session")
def tiny_fp8_dir(tmp_path_factory, tiny_hf_dir):
    out = tmp_path_factory.mktemp("tiny_fp8") / "ckpt"
    convert(tiny_hf_dir, out, experts="fp8", progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_bf16_dir(tmp_path_factory, tiny_hf_dir):
    out = tmp_path_factory.mktemp("tiny_bf16") / "ckpt"
    convert(tiny_hf_dir, out, experts="bf16", progress=False)
    return out


def random_rows(cfg, batch: int, length: int, seed: int, semantic_from: int = 0) -> np.ndarray:
    """Frame rows [B, T, 1+K]: random text rows, then random semantic rows from `semantic_from` on."""
    r = np.random.default_rng(seed)
    K = cfg.num_codebooks
    rows = np.zeros((batch, length, 1 + K), np.int32)
    rows[..., 0] = r.integers(0, cfg.semantic_start_token_id, (batch, length))
    n = length - semantic_from
    c0 = r.integers(0, cfg.band_size, (batch, n))
    rows[:, semantic_from:, 0] = cfg.semantic_start_token_id + c0
    rows[:, semantic_from:, 1] = c0
    rows[:, semantic_from:, 2:] = r.integers(0, cfg.tower.vocab_size, (batch, n, K - 1))
    return rows
