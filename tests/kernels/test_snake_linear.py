"""The codec residual-unit tail kernel (kernels/snake_linear) against its plain-jnp reference in interpret mode, and
its lowering for the H200 (Pallas -> TTIR -> sm_90a) at the real codec's widths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.snake_linear.api import snake_linear_residual
from kernels.snake_linear.pallas_triton import snake_linear_residual_triton
from kernels.snake_linear.reference import snake_linear_residual_reference


def _inputs(m, k, n, dtype, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    h = (jax.random.normal(ks[0], (m, k)) * 2.0).astype(dtype)
    alpha = (1.0 + 0.6 * jax.random.normal(ks[1], (k,))).astype(dtype)  # some negative, some near zero
    alpha = alpha.at[0].set(0.0)                                          # 1 / (0 + 1e-9) * sin(0)^2 = 0
    w = (jax.random.normal(ks[2], (k, n)) / np.sqrt(k)).astype(dtype)
    b = (0.1 * jax.random.normal(ks[3], (n,))).astype(dtype)
    x = jax.random.normal(ks[4], (m, n)).astype(dtype)
    return h, alpha, w, b, x


def _f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


@pytest.mark.parametrize("m,k,n", [
    (256, 96, 96),    # the decoder's last block (96 channels): K and N in three chunks of 32
    (37, 96, 96),     # ragged rows (a masked last block)
    (64, 192, 192),   # 192 channels: chunks of 64
    (48, 384, 384),   # 384 channels: six chunks of 64, block_m 32
    (40, 48, 80),     # widths whose largest power-of-two divisor is 16
    (128, 64, 64),    # the tiny codec's widths (powers of two)
], ids=["c96", "ragged_rows", "c192", "c384", "odd_widths", "pow2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_reference(m, k, n, dtype):
    h, alpha, w, b, x = _inputs(m, k, n, dtype, m * 31 + k + n)
    got = _f32(snake_linear_residual_triton(h, alpha, w, b, x, interpret=True))
    want = _f32(snake_linear_residual_reference(h, alpha, w, b, x))
    assert got.shape == (m, n) and np.isfinite(got).all()
    scale = np.abs(want).max()
    # fp32: the two sum in another order; bf16: the reference rounds the product and the bias before adding x,
    # the kernel rounds once at the end (one or two bf16 steps of the output's scale)
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, atol=tol * scale, rtol=0)
    if dtype == jnp.bfloat16:  # and most elements agree far better than the bound
        assert np.mean(np.abs(got - want) <= 4e-3 * scale) > 0.95


def test_api_dispatch_and_validation():
    h, alpha, w, b, x = _inputs(32, 96, 96, jnp.float32, 0)
    ref = snake_linear_residual(h, alpha, w, b, x, backend="reference")
    np.testing.assert_array_equal(_f32(ref), _f32(snake_linear_residual_reference(h, alpha, w, b, x)))
    ker = snake_linear_residual(h, alpha, w, b, x, backend="pallas_triton", interpret=True)
    np.testing.assert_allclose(_f32(ker), _f32(ref), atol=2e-5 * np.abs(_f32(ref)).max())
    with pytest.raises(ValueError, match="wants h"):
        snake_linear_residual(h, alpha[:-1], w, b, x)
    with pytest.raises(ValueError, match="multiples of 16"):
        snake_linear_residual_triton(h[:, :40], alpha[:40], w[:40], b, x, interpret=True)
    with pytest.raises(ValueError, match="unknown snake_linear backend"):
        snake_linear_residual(h, alpha, w, b, x, backend="cuda")


@pytest.mark.parametrize("c", [96, 192, 384])
def test_lowers_for_h200_without_spills(c):
    from kernels.h200_lowering import capture_ttir, compile_ttir
    from kernels.snake_linear.pallas_triton import TUNING

    m = 128 * 8 * 2048 // (c // 48)  # rows of a 128-stream, 8-frame codec call at that block's rate
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    ttir = capture_ttir(lambda *a: snake_linear_residual_triton(*a, interpret=False),
                        sd((m, c), bf), sd((c,), bf), sd((c, c), bf), sd((c,), bf), sd((m, c), bf))
    report, _ = compile_ttir(ttir, TUNING["num_warps"], TUNING["num_stages"])
    assert report["spill_bytes"] == 0, report
