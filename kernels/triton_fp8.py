"""FP8 x FP8 dots on Hopper tensor cores (wgmma) from Pallas kernels with the Triton lowering.

Pallas's Triton lowering of `dot_general` (jax 0.11.2, `jax/_src/pallas/triton/lowering.py`) builds `tt.dot` without
`maxNumImpreciseAcc`, so it is 0. Triton's sm90 matmul pass accepts an FP8 x FP8 -> f32 dot for MMAv3 (wgmma) only
when that attribute is at least 32 (`supportMMA` in triton/lib/Analysis/Utility.cpp); otherwise it falls back to
mma.sync on operands converted to f16, at the f16 rate and with two conversions per element. Triton's own `tl.dot`
sets it to 2^30 for FP8 on sm90 (`max_num_imprecise_acc_default` in triton/backends/nvidia/compiler.py). Checked for
the H200 with kernels/h200_lowering.py: before, `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`; after,
`wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3`.

`enable()` re-registers the lowering of `dot_general` so that FP8 dots carry maxNumImpreciseAcc = K, the dot's own
contraction length: the whole K-long sum stays in the wgmma accumulator (no promotion inside one dot), and the MoE
kernels promote to fp32 themselves after every 128-wide K tile (the per-block scale), DeepGEMM's scheme. Every other
dot keeps jax's lowering unchanged.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_FP8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)
_installed = False


def _is_fp8(dtype) -> bool:
    return any(dtype == t for t in _FP8)


def enable() -> None:
    """Install the FP8-aware dot lowering (idempotent; affects Pallas-Triton lowering only)."""
    global _installed
    if _installed:
        return
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect
    from jax._src.pallas.triton import lowering

    jax_rule = lowering.triton_lowering_rules[lax.dot_general_p]

    def dot_general_rule(ctx, a, b, *, dimension_numbers, out_sharding, precision, preferred_element_type):
        a_aval, b_aval = ctx.avals_in
        default = precision is None or precision == lax.DotAlgorithmPreset.DEFAULT or precision == (
            lax.Precision.DEFAULT, lax.Precision.DEFAULT)
        (((ca,), (cb,)), batch) = dimension_numbers
        if not (_is_fp8(a_aval.dtype) and a_aval.dtype == b_aval.dtype and default and batch == ((), ())
                and len(a_aval.shape) == 2 and len(b_aval.shape) == 2):
            return jax_rule(ctx, a, b, dimension_numbers=dimension_numbers, out_sharding=out_sharding,
                            precision=precision, preferred_element_type=preferred_element_type)
        # the same steps as jax's rule for this case (operands to [m, k] x [k, n], fp32 accumulator), plus the
        # attribute
        if ca == 0:
            a = tt_dialect.trans(a, (1, 0))
        if cb == 1:
            b = tt_dialect.trans(b, (1, 0))
        m, k = ir.RankedTensorType(a.type).shape
        n = ir.RankedTensorType(b.type).shape[1]
        acc = lowering._zeros(ir.RankedTensorType.get([m, n], lowering._dtype_to_ir_type(jnp.float32)))
        acc = tt_dialect.dot(a, b, acc, max_num_imprecise_acc=k)
        [out_aval] = ctx.avals_out
        return lowering._cast(acc, jnp.float32, out_aval.dtype)

    lowering.triton_lowering_rules[lax.dot_general_p] = dot_general_rule
    _installed = True
