"""y = x @ w^T for a few rows (decode: 1-256) and a bf16 weight [N, K], as a Pallas kernel (Triton lowering).

XLA's GEMMs at these shapes put one 128-row tile on each of N / 128 output columns blocks: 4-64 programs for the
132 SMs of an H200, so a weight that should stream at HBM speed is read by a fraction of the GPU. Here each program
owns `block_n` output columns (and, with split_k, a slice of K), keeps all rows' [rows, block_n] fp32 accumulator in
registers and streams its weight tile through the K loop; the rows are re-read from L2 by every program. split_k
slices are written as fp32 partials and added after the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels.dense.tuning import DenseConfig, pick

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))
MIN_ROWS = 16  # the MMA's smallest side; rows are padded up to a power of two at least this
SMEM_BYTES = 200 * 1024  # pipeline buffers' budget (an H200 SM has 228 KB of shared memory per block at most)


def _linear_kernel(x_ref, w_ref, y_ref, *, bn, bk, n_k, swap_ab):
    n0 = pl.multiple_of(pl.program_id(0) * bn, bn)
    s = pl.program_id(1)

    def body(i, acc):
        k0 = pl.multiple_of((s * n_k + i) * bk, bk)
        xt = x_ref[:, pl.ds(k0, bk)]
        wt = w_ref[pl.ds(n0, bn), pl.ds(k0, bk)]
        if swap_ab:
            return acc + jax.lax.dot_general(wt, xt, _NT, preferred_element_type=_F32)
        return acc + jax.lax.dot_general(xt, wt, _NT, preferred_element_type=_F32)

    rows = x_ref.shape[0]
    acc = jax.lax.fori_loop(0, n_k, body, jnp.zeros((bn, rows) if swap_ab else (rows, bn), _F32))
    y_ref[s, :, pl.ds(n0, bn)] = (acc.T if swap_ab else acc).astype(y_ref.dtype)


def check_shapes(m: int, n: int, k: int, cfg: DenseConfig) -> None:
    """ValueError unless the kernel takes this (rows, N, K) with `cfg`."""
    if n % cfg.block_n or k % (cfg.block_k * cfg.split_k):
        raise ValueError(f"dense kernel: N={n} must be a multiple of block_n={cfg.block_n} and K={k} of "
                         f"block_k * split_k = {cfg.block_k * cfg.split_k}")
    if m > 256:
        raise ValueError(f"dense kernel: {m} rows; it is for decode sizes (at most 256 rows)")


def padded_rows(m: int) -> int:
    """Rows as the kernel sees them: the next power of two, at least MIN_ROWS (Triton block shapes)."""
    return max(MIN_ROWS, 1 << (m - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "interpret"))
def linear_pallas_triton(x: jax.Array, w: jax.Array, *, config: DenseConfig | None = None, out_dtype=None,
                         interpret: bool | None = None) -> jax.Array:
    """x [M, K] (any float dtype, cast to w's), w [N, K] bf16 -> [M, N] in out_dtype (default w.dtype), fp32
    accumulation. M <= 256."""
    m, k = x.shape
    n = w.shape[0]
    cfg = config or pick(n, k)
    check_shapes(m, n, k, cfg)
    mp = padded_rows(m)
    xp = x.astype(w.dtype)
    if mp != m:
        xp = jnp.pad(xp, ((0, mp - m), (0, 0)))
    split = cfg.split_k
    out_dtype = jnp.dtype(out_dtype or w.dtype)
    kernel = functools.partial(_linear_kernel, bn=cfg.block_n, bk=cfg.block_k, n_k=k // (cfg.block_k * split),
                               swap_ab=cfg.swap_ab)
    # each pipeline stage buffers one [rows, block_k] tile of x and one [block_n, block_k] tile of w
    stages = max(1, min(cfg.num_stages, SMEM_BYTES // ((mp + cfg.block_n) * cfg.block_k * xp.dtype.itemsize)))
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split, mp, n), _F32 if split > 1 else out_dtype),
        grid=(n // cfg.block_n, split),
        compiler_params=plt.CompilerParams(num_warps=cfg.num_warps, num_stages=stages),
        interpret=jax.default_backend() != "gpu" if interpret is None else interpret,
        name="dense_decode_linear",
    )(xp, w)
    y = y[0] if split == 1 else jnp.sum(y, axis=0).astype(out_dtype)
    return y[:m]
