"""Length-aware decode attention kernel (Pallas, Triton lowering) vs the plain-jnp reference, in interpret mode on CPU.

Cases: ragged kv_len with 0, 1, multiples of block_k and +-1 around them, the full cache L, values past L (clamped)
and negative ones; L not a multiple of block_k; GQA ratios 1, 2, 8 (group padded to 16 rows) and Hq = 16, Hkv = 2,
D = 256 (Drama 3 heads); one split and several, with splits wholly past a sequence's length; bf16 and fp32 inputs.
Tolerances (max |kernel - ref| / max |ref|): fp32 <= 1e-5; bf16 <= 1e-2 (bf16 probabilities in the second dot, the
bf16 output rounding). Cache rows past each length hold NaN, so reading a row past the length shows up as NaN.
The api test checks Tq == 1 through backend="pallas_triton" against "reference" and the Tq > 1 fallback; the
lowering test lowers the kernel for an (abstract) H200 at full shapes (kernels/attention/compile_check.py goes on to
PTX with the triton package).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels.attention import api, pallas_triton, reference
from kernels.dispatch import pick_backend
from kernels.h200_lowering import lower_for_h200

f32, bf16 = jnp.float32, jnp.bfloat16


@functools.lru_cache(maxsize=None)
def _kernel(scale, kw):
    return jax.jit(functools.partial(pallas_triton.decode_attention_triton, scale=scale, interpret=True, **dict(kw)))


_ref = jax.jit(reference.attention_reference, static_argnames=("scale",))


def inputs(seed, B, L, Hq, Hkv, D, kv_len, dtype):
    """Random q, caches (NaN past min(kv_len, L) in every row: never read), kv_len int32."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (B, Hq, D), f32) * 2.0
    k = jax.random.normal(ks[1], (B, L, Hkv, D), f32)
    v = jax.random.normal(ks[2], (B, L, Hkv, D), f32)
    kv_len = jnp.asarray(kv_len, jnp.int32)
    live = (jnp.arange(L)[None, :] < kv_len[:, None])[:, :, None, None]
    return q.astype(dtype), jnp.where(live, k, jnp.nan).astype(dtype), jnp.where(live, v, jnp.nan).astype(dtype), kv_len


def ref_decode(q, k, v, kv_len, scale):
    """The reference for one query per sequence at position kv_len - 1 (NaN rows past the length zeroed first: the
    reference multiplies masked probabilities (0) by them)."""
    L = k.shape[1]
    n = jnp.clip(kv_len, 0, L)
    live = (jnp.arange(L)[None, :] < n[:, None])[:, :, None, None]
    k, v = jnp.where(live, k, 0).astype(k.dtype), jnp.where(live, v, 0).astype(v.dtype)
    return _ref(q[:, None], k, v, (n - 1)[:, None], n, scale=scale)[:, 0]


def check(out, ref, kv_len, dtype):
    out, ref = np.asarray(out.astype(f32)), np.asarray(ref.astype(f32))
    assert out.dtype == ref.dtype and np.isfinite(out).all()
    assert (out[np.asarray(kv_len) <= 0] == 0).all()
    tol = 1e-5 if dtype == f32 else 1e-2
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= tol, err


@pytest.mark.parametrize("dtype", [f32, bf16])
@pytest.mark.parametrize("Hq,Hkv,D,block_k,num_splits", [
    (4, 4, 16, 16, 1),      # GQA 1, one split
    (4, 2, 32, 16, 3),      # GQA 2, splits past the length for the short rows
    (16, 2, 64, 32, 4),     # GQA 8
    (8, 1, 16, 8, 16),      # GQA 8, more splits than blocks for most rows
])
def test_kernel_vs_reference(dtype, Hq, Hkv, D, block_k, num_splits):
    L = 100                                            # not a multiple of block_k
    kv_len = [0, 1, block_k, block_k - 1, block_k + 1, 2 * block_k, 57, L, L + 7, -3]
    q, k, v, n = inputs(hash((Hq, Hkv, D, block_k)) % 1000, len(kv_len), L, Hq, Hkv, D, kv_len, dtype)
    scale = D ** -0.5
    out = _kernel(scale, (("block_k", block_k), ("num_splits", num_splits)))(q, k, v, n)
    assert out.shape == q.shape and out.dtype == dtype
    check(out, ref_decode(q, k, v, n, scale), n, dtype)


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_kernel_drama3_heads(dtype):
    """Hq 16, Hkv 2, D 256, the default tuning (block_k 64, automatic splits)."""
    L = 150
    kv_len = [150, 0, 64, 93]
    q, k, v, n = inputs(7, len(kv_len), L, 16, 2, 256, kv_len, dtype)
    out = _kernel(256 ** -0.5, ())(q, k, v, n)
    check(out, ref_decode(q, k, v, n, 256 ** -0.5), n, dtype)


@pytest.mark.parametrize("backend", ["pallas_triton", "reference"])
def test_api_decode_over_a_pool_prefix(backend):
    """q for rows [0, 3) of a 5-row cache pool: the same output as the 3-row cache alone (rows 3..4 hold NaN: never
    read), through the api, kernel in interpret mode and reference."""
    L, Hq, Hkv, D = 48, 4, 2, 16
    kv_len = [17, 48, 5]
    q, k, v, n = inputs(5, 3, L, Hq, Hkv, D, kv_len, f32)
    pool = lambda x: jnp.concatenate([x, jnp.full((2,) + x.shape[1:], jnp.nan, x.dtype)])
    run = jax.jit(functools.partial(api.attention, scale=0.25, backend=backend,
                                    **({"interpret": True} if backend != "reference" else {})))
    q_pos = (n - 1)[:, None]
    got = run(q[:, None], pool(jnp.nan_to_num(k)), pool(jnp.nan_to_num(v)), q_pos, n)
    want = run(q[:, None], jnp.nan_to_num(k), jnp.nan_to_num(v), q_pos, n)
    assert got.shape == (3, 1, Hq, D)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_auto_splits():
    assert pallas_triton.auto_splits(1, 2, 4100, 64, 528, 16) == 16
    assert pallas_triton.auto_splits(128, 2, 4100, 64, 528, 16) == 3
    assert pallas_triton.auto_splits(256, 2, 4100, 64, 528, 16) == 2
    assert pallas_triton.auto_splits(1, 2, 100, 64, 528, 16) == 2        # at most one split per key block


# ------------------------------------------------------------------------------------------------ prefill kernel
@functools.lru_cache(maxsize=None)
def _prefill(scale, kw):
    return jax.jit(functools.partial(pallas_triton.prefill_attention_triton, scale=scale, interpret=True,
                                     **dict(kw)))


def prefill_case(seed, B, Tq, S, L, Hq, Hkv, D, kv_len, dtype):
    """q [B, Tq]; k, v [S, L] cache pools (S >= B) with NaN past each kv_len and in the rows past B (never read)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = (jax.random.normal(ks[0], (B, Tq, Hq, D), f32) * 2.0).astype(dtype)
    k = jax.random.normal(ks[1], (S, L, Hkv, D), f32)
    v = jax.random.normal(ks[2], (S, L, Hkv, D), f32)
    n = jnp.asarray(kv_len + [0] * (S - B), jnp.int32)
    live = (jnp.arange(L)[None, :] < n[:, None])[:, :, None, None]
    k, v = jnp.where(live, k, jnp.nan).astype(dtype), jnp.where(live, v, jnp.nan).astype(dtype)
    return q, k, v, n[:B], jnp.where(live, k, 0)[:B].astype(dtype), jnp.where(live, v, 0)[:B].astype(dtype)


@pytest.mark.parametrize("dtype,Hq,Hkv,D,block_q,block_k", [(f32, 4, 2, 32, 16, 16), (bf16, 16, 2, 64, 32, 16),
                                                          (f32, 2, 2, 16, 16, 32)])
def test_prefill_kernel_vs_reference(dtype, Hq, Hkv, D, block_q, block_k):
    """A fresh prefill (q_pos = 0..Tq-1, keys = the new rows: lengths 70, 1, 33, 0, rows past a length see the
    length's keys) and a chunk over a cache (q_pos = start + t, kv_len = start + 24 with start 0, 40, 100, 7: the
    query blocks end at different key blocks), in a pool with more rows than sequences."""
    scale = D ** -0.5
    run = _prefill(scale, (("block_q", block_q), ("block_k", block_k)))
    lengths = [70, 1, 33, 0]
    q, k, v, n, k0, v0 = prefill_case(11, 4, 70, 6, 70, Hq, Hkv, D, lengths, dtype)
    q_pos = jnp.broadcast_to(jnp.arange(70, dtype=jnp.int32), (4, 70))
    out = run(q, k, v, q_pos, n)
    assert out.shape == q.shape and out.dtype == dtype
    check(out, _ref(q, k0, v0, q_pos, n, scale=scale), n, dtype)
    assert not np.asarray(out[3]).any()  # no key: zeros
    start = jnp.array([0, 40, 100, 7], jnp.int32)
    q, k, v, n, k0, v0 = prefill_case(12, 4, 24, 5, 130, Hq, Hkv, D, (start + 24).tolist(), dtype)
    q_pos = start[:, None] + jnp.arange(24, dtype=jnp.int32)[None, :]
    check(run(q, k, v, q_pos, n), _ref(q, k0, v0, q_pos, n, scale=scale), n, dtype)


def test_prefill_kernel_drama3_heads_through_the_api():
    """Hq 16, Hkv 2, D 256, the default tuning, via backend "pallas_triton" (Tq > 1); Tq == 1 on that backend is
    the decode kernel, as on "pallas_triton_decode"."""
    lengths = [96, 65]
    q, k, v, n, k0, v0 = prefill_case(13, 2, 96, 2, 96, 16, 2, 256, lengths, f32)
    q_pos = jnp.broadcast_to(jnp.arange(96, dtype=jnp.int32), (2, 96))
    run = jax.jit(functools.partial(api.attention, scale=1 / 16, backend="pallas_triton", interpret=True))
    check(run(q, k0, v0, q_pos, n), _ref(q, k0, v0, q_pos, n, scale=1 / 16), n, f32)
    qd, qpd = q[:, :1], (n - 1)[:, None]
    np.testing.assert_array_equal(np.asarray(run(qd, k0, v0, qpd, n)), np.asarray(jax.jit(functools.partial(
        api.attention, scale=1 / 16, backend="pallas_triton_decode", interpret=True))(qd, k0, v0, qpd, n)))


# ------------------------------------------------------------------------------------------------ api / lowering
def test_api_decode_and_fallback():
    """Tq == 1 through the kernel equals the reference, also where kv_len and q_pos + 1 differ (the smaller wins, as
    in the reference's mask); on "pallas_triton_decode" Tq > 1 falls back to the reference exactly."""
    B, L, Hq, Hkv, D = 4, 40, 4, 2, 16
    ks = jax.random.split(jax.random.PRNGKey(3), 3)
    q = jax.random.normal(ks[0], (B, 3, Hq, D), f32)
    k = jax.random.normal(ks[1], (B, L, Hkv, D), f32)
    v = jax.random.normal(ks[2], (B, L, Hkv, D), f32)
    kv_len = jnp.array([17, 0, 40, 9], jnp.int32)
    q_pos1 = jnp.array([[16], [0], [20], [30]], jnp.int32)       # decode, none visible, q_pos < kv_len - 1, beyond
    run = lambda backend, qq, qp: jax.jit(functools.partial(api.attention, scale=0.25, backend=backend,
                                                            **({"interpret": True} if backend != "reference" else
                                                               {})))(qq, k, v, qp, kv_len)
    o_k, o_r = run("pallas_triton", q[:, :1], q_pos1), run("reference", q[:, :1], q_pos1)
    assert o_k.shape == (B, 1, Hq, D)
    np.testing.assert_allclose(np.asarray(o_k), np.asarray(o_r), rtol=1e-5, atol=1e-5)
    assert (np.asarray(o_k[1]) == 0).all()
    q_pos3 = jnp.array([[14, 15, 16], [0, 1, 2], [37, 38, 39], [6, 7, 8]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(run("pallas_triton_decode", q, q_pos3)),
                                  np.asarray(run("reference", q, q_pos3)))


def test_dispatch():
    assert jax.default_backend() == "cpu"
    assert pick_backend(api.BACKENDS, "auto", "attention", auto="pallas_triton") is api.BACKENDS["reference"]
    with pytest.raises(ValueError, match="unknown attention backend"):
        api.attention(jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, 4, 1, 8)),
                      jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), scale=1.0, backend="nope")


def test_backends_auto_uses_attention_kernel():
    from drama3_jax.backbone import Backends
    assert Backends.auto().attention == "auto"


def test_triton_lowering_full_shapes_for_h200():
    """One Triton custom call at Drama 3 shapes (128 streams, 4100-row bf16 cache; and fp32) for an abstract H200."""
    sd = jax.ShapeDtypeStruct
    B, L, Hq, Hkv, D = 128, 4100, 16, 2, 256
    for dt in (bf16, f32):
        fn = functools.partial(api.attention, scale=D ** -0.5, backend="pallas_triton")
        txt = lower_for_h200(fn, sd((B, 1, Hq, D), dt), sd((B, L, Hkv, D), dt), sd((B, L, Hkv, D), dt),
                             sd((B, 1), jnp.int32), sd((B,), jnp.int32))
        assert txt.count("__gpu$xla.gpu.triton") == 1
    P, T = 8, 512  # the prefill kernel at a packed call's lanes
    fn = functools.partial(api.attention, scale=D ** -0.5, backend="pallas_triton")
    txt = lower_for_h200(fn, sd((P, T, Hq, D), bf16), sd((P, T, Hkv, D), bf16), sd((P, T, Hkv, D), bf16),
                         sd((P, T), jnp.int32), sd((P,), jnp.int32))
    assert txt.count("__gpu$xla.gpu.triton") == 1
