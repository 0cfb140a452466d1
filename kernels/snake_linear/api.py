"""Public entry point of the snake_linear op; `backend` picks the implementation.

Backends of `snake_linear_residual`:
  "reference"      plain jnp (kernels/snake_linear/reference.py). In XLA on a GPU: a pass for the Snake (the GEMM
                   fusion does not take `sin` into its prologue), the GEMM with the bias, and the residual add left
                   to each consumer of the sum (experiments/results/hlo_census_2026-12-08/).
  "pallas_triton"  one Pallas launch (kernels/snake_linear/pallas_triton.py): the Snake in the GEMM's prologue, the
                   bias and the residual add in its epilogue; h and x read once, the sum written once.
  "auto"           "pallas_triton" when JAX's default backend is a GPU, else "reference".
"""

from __future__ import annotations

from kernels.dispatch import pick_backend
from kernels.snake_linear.pallas_triton import snake_linear_residual_triton, supports
from kernels.snake_linear.reference import snake, snake_linear_residual_reference

BACKENDS = {"reference": snake_linear_residual_reference, "pallas_triton": snake_linear_residual_triton}


def snake_linear_residual(h, alpha, w, b, x, *, backend: str = "reference", **backend_kwargs):
    """x + (snake(h; alpha) @ w + b): h [M, K], alpha [K], w [K, N], b [N], x [M, N] -> [M, N] in x.dtype."""
    M, K = h.shape
    if alpha.shape != (K,) or w.shape[0] != K or x.shape != (M, w.shape[1]) or b.shape != (w.shape[1],):
        raise ValueError(f"snake_linear_residual wants h [M, K], alpha [K], w [K, N], b [N], x [M, N]; got "
                         f"{h.shape}, {alpha.shape}, {w.shape}, {b.shape}, {x.shape}")
    fn = pick_backend(BACKENDS, backend, "snake_linear", auto="pallas_triton")
    return fn(h, alpha, w, b, x, **backend_kwargs)


__all__ = ["BACKENDS", "snake", "snake_linear_residual", "supports"]
