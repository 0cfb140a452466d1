"""MoE router top-k as one Pallas (Triton lowering) launch: `router_topk_triton`.

In the decode step at 128 streams `lax.top_k` over [128, 256] fp32 router logits and the softmax of its 8 values are
two XLA kernels per layer (0.168 + 0.061 ms of the step's 17.9 ms over 40 layers, H200 profile in
experiments/results/decode_profile_2026-12-02b/); in a 3,072-row prefill call the top-k alone is 1.07 ms
(experiments/results/profiles_2026-12-04/prefill/). Here each program takes `block_rows` rows as one [rows, E] tile
and runs k rounds of (row max, lowest column holding it, mask it out), then exp / sum over the k values: the same ids
as `lax.top_k` (ties to the lower expert index) and the same softmax. The rounds compare int32 keys in IEEE total
order, as `lax.top_k` does (-0.0 below +0.0), and E is padded to a power of two with keys below every float (never
picked while a real column is left: E >= k).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

f32 = jnp.float32

# rows per program and warps: few rows per program keep the k sequential rounds of row reductions short (one warp's
# shuffles for a [4, 256] tile). Not yet timed on the H200 (experiments/router_bench.py times it against lax.top_k).
TUNING = {"block_rows": 4, "num_warps": 1}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


_KEY_MIN = -(2 ** 31)  # below every float's key: padding columns and picked ones


def _order_key(x):
    """fp32 -> int32 with the order of `lax.top_k` (IEEE total order: -0.0 below +0.0): the bits, with the magnitude
    bits flipped for negative numbers."""
    b = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(b < 0, b ^ 0x7FFFFFFF, b)


def _from_order_key(key):
    return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), f32)


def _router_kernel(x_ref, ids_ref, w_ref, *, n, e, k, br, ep, kp):
    row0 = pl.program_id(0) * br
    r = row0 + jnp.arange(br, dtype=jnp.int32)
    c = jnp.arange(ep, dtype=jnp.int32)
    ok = (r[:, None] < n) & (c[None, :] < e)
    x = plt.load(x_ref.at[pl.ds(row0, br), pl.ds(0, ep)], mask=ok, other=0.0).astype(f32)
    key = jnp.where(ok, _order_key(x), _KEY_MIN)
    j = jnp.arange(kp, dtype=jnp.int32)
    top = jnp.full((br, kp), _KEY_MIN, jnp.int32)
    ids = jnp.zeros((br, kp), jnp.int32)
    for i in range(k):
        m = jnp.max(key, axis=1)                                                # [br]
        at = jnp.min(jnp.where(key == m[:, None], c[None, :], ep), axis=1)    # lowest column holding the max
        top = jnp.where(j[None, :] == i, m[:, None], top)
        ids = jnp.where(j[None, :] == i, at[:, None], ids)
        key = jnp.where(c[None, :] == at[:, None], _KEY_MIN, key)
        if i == 0:
            row_max = m
    top, row_max = _from_order_key(top), _from_order_key(row_max)
    p = jnp.where(j[None, :] < k, jnp.exp(top - row_max[:, None]), 0.0)
    w = p / jnp.sum(p, axis=1, keepdims=True)
    out = (r[:, None] < n) & (j[None, :] < k)
    plt.store(ids_ref.at[pl.ds(row0, br), pl.ds(0, kp)], ids, mask=out)
    plt.store(w_ref.at[pl.ds(row0, br), pl.ds(0, kp)], w, mask=out)


def router_topk_triton(logits, k: int, *, num_experts: int | None = None, block_rows: int | None = None,
                       num_warps: int | None = None, interpret: bool | None = None):
    """logits [N, E] -> (ids [N, k] int32, weights [N, k] fp32), as `reference.router_topk_reference`; with
    num_experts, the first num_experts columns of logits [N, W] (read in place). interpret=None runs the kernel on GPU
    and in Pallas interpret mode elsewhere."""
    n, e = logits.shape[0], num_experts or logits.shape[1]
    if not 1 <= k <= e:
        raise ValueError(f"router top-k needs 1 <= k <= E, got k={k}, E={e}")
    br = block_rows or TUNING["block_rows"]
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    ep, kp = _pow2(e), _pow2(k)
    kern = functools.partial(_router_kernel, n=n, e=e, k=k, br=br, ep=ep, kp=kp)
    return pl.pallas_call(
        kern, grid=(pl.cdiv(n, br),),
        out_shape=(jax.ShapeDtypeStruct((n, k), jnp.int32), jax.ShapeDtypeStruct((n, k), f32)),
        compiler_params=plt.CompilerParams(num_warps=num_warps or TUNING["num_warps"], num_stages=1),
        interpret=interpret, name="router_topk",
    )(logits)
