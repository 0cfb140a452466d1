"""Decode-size dense kernel (kernels/dense) vs the XLA reference, on CPU (Pallas interpret mode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.dense import tuning
from kernels.dense.api import linear
from kernels.dense.pallas_triton import check_shapes, linear_pallas_triton, padded_rows
from kernels.dense.reference import linear_reference

Cfg = tuning.DenseConfig


def inputs(m, n, k, seed, dtype=jnp.bfloat16):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (n, k), jnp.float32) * k ** -0.5).astype(dtype)
    return x, w


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("m,n,k,cfg", [
    (128, 256, 512, Cfg(block_n=32, split_k=2)),          # decode rows, K split in two
    (1, 64, 256, Cfg(block_n=16, swap_ab=True)),          # one row: padded to 16, weight tile as the MMA's M side
    (33, 128, 1024, Cfg(block_n=32, split_k=4)),          # ragged rows (padded to 64)
    (256, 96, 384, Cfg(block_n=32, num_stages=3)),        # the most rows; N and K not powers of two
    (96, 32, 256, Cfg(block_n=16, split_k=2, swap_ab=True)),
])
def test_kernel_matches_reference_bf16(m, n, k, cfg):
    x, w = inputs(m, n, k, seed=m + n + k)
    got = linear_pallas_triton(x, w, config=cfg, interpret=True)
    want = linear_reference(x, w)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    assert rel(got, want) < 1e-2
    assert np.isfinite(np.asarray(got, np.float32)).all()


def test_kernel_fp32_output_and_weights():
    """fp32 out_dtype keeps the accumulator (the router's logits); fp32 weights match to fp32 rounding."""
    x, w = inputs(64, 128, 256, seed=3)
    got = linear_pallas_triton(x, w, config=Cfg(block_n=32, split_k=2), out_dtype=jnp.float32, interpret=True)
    want = linear_reference(x, w, jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    x, w = inputs(16, 64, 256, seed=4, dtype=jnp.float32)
    got = linear_pallas_triton(x, w, config=Cfg(block_n=16, split_k=2), interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(linear_reference(x, w)), rtol=1e-5, atol=1e-5)


def test_api_dispatch_and_fallbacks():
    """'pallas' runs the kernel where the shape fits and XLA's GEMM elsewhere (more than 256 rows, N or K off the
    tiles), with any leading dims; 'reference' and unknown names."""
    x, w = inputs(2 * 64, 256, 512, seed=5)
    x3 = x.reshape(2, 64, 512)
    got = linear(x3, w, backend="pallas", interpret=True)
    assert got.shape == (2, 64, 256)
    assert rel(got.reshape(128, 256), linear_reference(x, w)) < 1e-2
    for m, n, k in ((300, 256, 512), (8, 40, 512), (8, 256, 200)):  # too many rows, N % 32, K % 128
        xx, ww = inputs(m, n, k, seed=m + n)
        np.testing.assert_array_equal(np.asarray(linear(xx, ww, backend="pallas"), np.float32),
                                      np.asarray(linear_reference(xx, ww), np.float32))
    np.testing.assert_array_equal(np.asarray(linear(x3, w), np.float32),
                                  np.asarray(linear_reference(x3, w), np.float32))
    with pytest.raises(ValueError, match="dense backend"):
        linear(x, w, backend="cutlass")


def test_tuning_and_shape_rules():
    for n, k in ((8192, 2048), (4096, 2048), (2048, 4096), (2048, 512), (512, 2048), (256, 2048), (32, 2048),
                 (9216, 2048), (6144, 2048), (2048, 6144)):
        cfg = tuning.pick(n, k)
        check_shapes(128, n, k, cfg)  # every shape of the full model's decode step has a valid row
        assert (n // cfg.block_n) * cfg.split_k >= 16
    assert tuning.pick(512, 384).split_k == 1  # 384 = 3 tiles: split 8 -> 4 -> 2 -> 1
    assert tuning.pick(512, 512).split_k == 4
    with pytest.raises(ValueError, match="at most 256 rows"):
        check_shapes(257, 256, 512, Cfg())
    with pytest.raises(ValueError, match="multiple of block_n"):
        check_shapes(8, 48, 512, Cfg(block_n=32))
    assert [padded_rows(m) for m in (1, 16, 17, 96, 128, 129, 256)] == [16, 16, 32, 128, 128, 256, 256]
