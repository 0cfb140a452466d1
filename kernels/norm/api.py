"""Public entry points of the norm op; `backend` picks the implementation of the fused one.

Backends of `add_rms_norm`:
  "reference"      plain jnp (kernels/norm/reference.py): XLA makes it ~4 kernels (the add and the sum of squares,
                   the scaling, and with quant_group the group maxima and the e4m3 conversion).
  "pallas_triton"  one Pallas launch (kernels/norm/pallas_triton.py), a program per row.
  "auto"           "pallas_triton" when JAX's default backend is a GPU, else "reference".
"""

from __future__ import annotations

from kernels.dispatch import pick_backend
from kernels.norm.pallas_triton import add_rms_norm_triton
from kernels.norm.reference import add_rms_norm_reference, rms_norm

BACKENDS = {"reference": add_rms_norm_reference, "pallas_triton": add_rms_norm_triton}


def add_rms_norm(x, residual, weight, *, eps: float, zero_centered: bool = True, quant_group: int | None = None,
                 backend: str = "reference", **backend_kwargs):
    """x, residual [N, H] (same dtype), weight [H] -> (s = x + residual, y = rms_norm(s)) in x.dtype, and with
    quant_group (H a multiple of it) also y's e4m3 groups (q [N, H] float8_e4m3fn, scale [N, H / quant_group] fp32)."""
    if x.shape != residual.shape or x.ndim != 2 or weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm wants x, residual [N, H] and weight [H]; got {x.shape}, {residual.shape}, "
                         f"{weight.shape}")
    if quant_group is not None and x.shape[-1] % quant_group:
        raise ValueError(f"width {x.shape[-1]} is not a multiple of the FP8 group {quant_group}")
    fn = pick_backend(BACKENDS, backend, "norm", auto="pallas_triton")
    return fn(x, residual, weight, eps=eps, zero_centered=zero_centered, quant_group=quant_group, **backend_kwargs)


__all__ = ["BACKENDS", "add_rms_norm", "rms_norm"]
