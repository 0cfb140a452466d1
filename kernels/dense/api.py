"""Public entry point of the dense projections; `backend` picks the implementation.

Backends:
  "reference"      `jax.lax.dot_general` (XLA's GEMM): every shape.
  "pallas_triton"  the decode-size kernel (kernels/dense/pallas_triton.py): at most 256 rows, N a multiple of its
                   block_n and K of block_k * split_k; other shapes go to the reference.
  "pallas"         the default Pallas GPU backend (currently "pallas_triton").
"""

from __future__ import annotations

import jax

from kernels.dense import tuning
from kernels.dense.pallas_triton import check_shapes, linear_pallas_triton
from kernels.dense.reference import linear_reference
from kernels.dispatch import pick_backend


def _pallas_or_reference(x, w, out_dtype=None, **options):
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    try:
        check_shapes(m, n, k, options.get("config") or tuning.pick(n, k))
    except ValueError:
        return linear_reference(x, w, out_dtype)
    return linear_pallas_triton(x, w, out_dtype=out_dtype, **options)


BACKENDS = {"reference": linear_reference, "pallas_triton": _pallas_or_reference}
BACKENDS["pallas"] = BACKENDS["pallas_triton"]


def linear(x: jax.Array, w: jax.Array, *, backend: str = "reference", out_dtype=None, **options) -> jax.Array:
    """y = x @ w^T. x [..., K], w [N, K] (the checkpoint's [out, in]) -> [..., N] in out_dtype (default w.dtype),
    fp32 accumulation."""
    fn = pick_backend(BACKENDS, backend, "dense", auto="pallas_triton")
    if fn is linear_reference:
        return linear_reference(x, w, out_dtype)
    lead = x.shape[:-1]
    return fn(x.reshape(-1, x.shape[-1]), w, out_dtype, **options).reshape(*lead, w.shape[0])


__all__ = ["linear", "BACKENDS"]
