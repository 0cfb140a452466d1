"""x + (snake(h) @ w + b) as one Pallas GPU launch (Triton lowering): the codec residual unit's tail.

In XLA the unit's tail is three memory passes over a [B*T, C] activation. At the decoder's two widest rates these are
128 x 8,192 x 192 and 128 x 16,384 x 96 bf16, 403 MB each, in a 128-stream call of 8 frames. The passes are:
- the Snake, on its own: the GEMM fusion does not take `sin` into its prologue;
- the 1x1 GEMM with its bias;
- the residual add. XLA never writes it: each consumer of the sum recomputes it from the unit's inputs
  (experiments/results/hlo_census_2026-12-08/).
Here a program owns `block_m` rows and all N output columns. For each K chunk it loads h once, applies the Snake in
registers and multiplies that into one fp32 accumulator per N chunk. It then adds the bias and x and writes the sum
once.

Channel counts are 3 x 2^k in the real codec (96, 192, 384, 768). A Triton tile must have a power-of-two size, so K
and N are walked in power-of-two chunks (32 for 96, 64 for 192 and 384). Both must be multiples of 16 (the MMA's
smallest side; `supports`); rows may be ragged (the last block is masked).

Numerics follow `reference.snake_linear_residual_reference` up to rounding. The Snake is computed in fp32 and rounded
to w's dtype before the product; the product accumulates in fp32. Unlike the reference, which rounds the product and
the bias to w's dtype before adding x, the kernel adds the bias and x in fp32 and rounds once. Triton's fp32 division
and `sin` are not XLA's, so bf16 outputs can differ from the reference by a rounding step; the tests bound this.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

f32 = jnp.float32
MAX_CHUNK = 64       # K and N chunk: the largest power of two dividing the width, at most this (128 spills at 384)
ACC_ELEMENTS = 16384  # fp32 accumulator elements per program (block_m x N): 64 KB of registers over 8 warps

# Not yet timed on the H200 (experiments/codec_throughput.py --variants default snake_linear_kernel
# snake_linear_kernel_4warps is the A/B, the second with 4 warps and ACC_ELEMENTS 8192).
TUNING = {"num_warps": 8, "num_stages": 1}


def supports(k: int, n: int) -> bool:
    """Whether the kernel takes a [K] -> [N] tail: both widths multiples of 16."""
    return k % 16 == 0 and n % 16 == 0


def _chunk(n: int) -> int:
    """The largest power of two dividing n, capped at MAX_CHUNK."""
    return min(n & -n, MAX_CHUNK)


def _block_m(m: int, n: int) -> int:
    """Rows per program: a power of two in [16, 128] keeping block_m x N fp32 within ACC_ELEMENTS, at most m's
    next power of two."""
    bm = 128
    while bm > 16 and bm * n > ACC_ELEMENTS:
        bm //= 2
    return max(16, min(bm, 1 << max(0, (m - 1).bit_length())))


def _kernel(h_ref, a_ref, w_ref, b_ref, x_ref, o_ref, *, M, K, N, BM, BK, BN):
    m0 = pl.program_id(0) * BM
    rows_ok = (m0 + jax.lax.broadcasted_iota(jnp.int32, (BM, 1), 0)) < M

    def k_chunk(i, accs):  # a loop, not unrolled: one K chunk of w is live at a time
        k0 = pl.multiple_of(i * BK, BK)
        h = plt.load(h_ref.at[pl.ds(m0, BM), pl.ds(k0, BK)], mask=jnp.broadcast_to(rows_ok, (BM, BK)), other=0)
        a = a_ref[pl.ds(k0, BK)].astype(f32)[None, :]
        hf = h.astype(f32)
        s = (hf + (1.0 / (a + 1e-9)) * jnp.sin(a * hf) ** 2).astype(w_ref.dtype)
        return tuple(acc + jnp.dot(s, w_ref[pl.ds(k0, BK), pl.ds(j * BN, BN)], preferred_element_type=f32)
                     for j, acc in enumerate(accs))

    accs = jax.lax.fori_loop(0, K // BK, k_chunk, tuple(jnp.zeros((BM, BN), f32) for _ in range(N // BN)))
    for j, acc in enumerate(accs):
        tile, ok = (pl.ds(m0, BM), pl.ds(j * BN, BN)), jnp.broadcast_to(rows_ok, (BM, BN))
        x = plt.load(x_ref.at[tile], mask=ok, other=0).astype(f32)
        b = b_ref[pl.ds(j * BN, BN)].astype(f32)[None, :]
        plt.store(o_ref.at[tile], (x + acc + b).astype(o_ref.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("num_warps", "interpret"))
def snake_linear_residual_triton(h, alpha, w, b, x, *, num_warps: int | None = None, interpret: bool | None = None):
    """Same contract as `reference.snake_linear_residual_reference`: h [M, K], alpha [K], w [K, N], b [N], x [M, N]
    -> [M, N] in x.dtype; K and N multiples of 16. interpret=None runs the kernel on GPU and in Pallas interpret
    mode elsewhere."""
    M, K = h.shape
    N = w.shape[1]
    if not supports(K, N):
        raise ValueError(f"snake_linear kernel: K={K} and N={N} must be multiples of 16")
    BK, BN = _chunk(K), _chunk(N)
    BM = _block_m(M, N)
    kernel = functools.partial(_kernel, M=M, K=K, N=N, BM=BM, BK=BK, BN=BN)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((M, N), x.dtype),
        grid=(-(-M // BM),),
        compiler_params=plt.CompilerParams(num_warps=num_warps or TUNING["num_warps"],
                                           num_stages=TUNING["num_stages"]),
        interpret=jax.default_backend() != "gpu" if interpret is None else interpret,
        name="codec_snake_linear_residual",
    )(h, alpha, w, b, x)
