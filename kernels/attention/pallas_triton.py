"""Length-aware GQA decode attention (one query per sequence over a KV cache) as a Pallas GPU kernel, Triton lowering;
and `prefill_attention_triton`, flash attention for many queries per sequence (prefill), at the end of this file.

Flash-decoding: grid (sequence b, kv head h, split s). Sequence b's visible keys 0 .. n_b - 1 (n_b = kv_len[b]
clamped into [0, L]) are cut into block_k-row blocks, and those blocks are dealt out in contiguous runs to the
`num_splits` programs of (b, h); each program walks only its run (a loop with a traced trip count, lowered to
scf.for), so the cache is read up to each slot's length and no further, and a short batch still fills the SMs.
One program serves all Hq / Hkv query heads of its kv head: the group is loaded as >= 16 rows (masked, zeros past
the group) for the tensor-core dot (decode is memory bound: the padding rows cost compute only and are never
stored). Each program keeps the online-softmax running max m, denominator l and unnormalised output acc (fp32) and
writes them as partials; the splits are merged in plain jnp (`_combine`). A split that got no block leaves m = -inf,
l = 0, acc = 0, and a sequence with n_b = 0 gives zeros.

Numerics as the reference: scores q.k in fp32 (fp32 inputs: IEEE fp32 dots) times `scale`, softmax in fp32,
probabilities cast to v's dtype for the second dot (fp32 accumulation), output in q's dtype.

Tuning values live in TUNING (data): block_k keys per loop step; num_splits None = enough programs for
`target_programs` (about 4 per SM on the H200), at most `max_splits` and at most one split per key block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

f32 = jnp.float32
MIN_ROWS = 16  # smallest M of a tensor-core dot

# Defaults: a first choice, checked only by compiling for sm_90 (compile_check.py: no spills, 74 KB shared memory at
# 2 stages); experiments/attention_bench.py times them against variants on the H200.
TUNING = {"block_k": 64, "num_splits": None, "num_warps": 4, "num_stages": 2, "target_programs": 528,
          "max_splits": 16}


def _params(overrides: dict, table: dict | None = None) -> dict:
    """`table` (default TUNING) with the overrides that are not None."""
    p = dict(TUNING if table is None else table)
    p.update({k: v for k, v in overrides.items() if v is not None})
    return p


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def auto_splits(B: int, Hkv: int, L: int, block_k: int, target_programs: int, max_splits: int) -> int:
    """Splits per (sequence, kv head): enough programs for `target_programs`, within [1, max_splits] and at most one
    per key block of the cache."""
    want = -(-target_programs // (B * Hkv))
    return max(1, min(want, max_splits, -(-L // block_k)))


def walk_split(k_ref, v_ref, q, n, init, *, b, h, s, BK, NS, scale, prec):
    """Online softmax of the query group q [Gp, D] over split s's run of the key blocks 0 .. n - 1 of sequence b,
    kv head h (the blocks dealt out in contiguous runs to NS splits), from carry init = (m, l, acc). Returns
    (m [Gp], l [Gp], acc [Gp, D]) fp32; a split that gets no block returns init."""
    Gp, D = q.shape
    nblk = (n + BK - 1) // BK
    per = (nblk + NS - 1) // NS
    lo = jnp.minimum(s * per, nblk)
    hi = jnp.minimum(lo + per, nblk)
    kr = jax.lax.broadcasted_iota(jnp.int32, (BK, 1), 0)

    def body(j, carry):
        m, l, acc = carry
        rows = pl.ds(j * BK, BK)
        live = (j * BK + kr) < n                                # [BK, 1]
        k = plt.load(k_ref.at[b, rows, h, :], mask=jnp.broadcast_to(live, (BK, D)), other=0).astype(q.dtype)
        v = plt.load(v_ref.at[b, rows, h, :], mask=jnp.broadcast_to(live, (BK, D)), other=0).astype(q.dtype)
        sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=f32)
        sc = jnp.where(jnp.broadcast_to(live.reshape(1, BK), (Gp, BK)), sc * scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))             # finite: every walked block has a live key
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(sc - m_new[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                                 preferred_element_type=f32)
        return m_new, l, acc * alpha[:, None] + pv

    return jax.lax.fori_loop(lo, hi, body, init)


def _kernel(len_ref, q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *, G, Gp, D, BK, NS, scale, prec):
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    grp = jax.lax.broadcasted_iota(jnp.int32, (Gp,), 0) < G     # real query rows of the padded group
    q = plt.load(q_ref.at[b, pl.ds(h * G, Gp), :], mask=jnp.broadcast_to(grp[:, None], (Gp, D)), other=0)
    init = (jnp.full((Gp,), -jnp.inf, f32), jnp.zeros((Gp,), f32), jnp.zeros((Gp, D), f32))
    m, l, acc = walk_split(k_ref, v_ref, q, len_ref[b], init, b=b, h=h, s=s, BK=BK, NS=NS, scale=scale, prec=prec)
    plt.store(m_ref.at[b, h, s, :], m, mask=grp)
    plt.store(l_ref.at[b, h, s, :], l, mask=grp)
    plt.store(acc_ref.at[b, h, s, :, :], acc, mask=jnp.broadcast_to(grp[:, None], (Gp, D)))


def combine_splits(m, l, acc, G):
    """Merge the split partials m, l [B, Hkv, NS, Gp], acc [B, Hkv, NS, Gp, D] (rows >= G unwritten) into
    [B, Hkv, G, D] fp32; zeros where no key was visible."""
    m, l, acc = m[..., :G], l[..., :G], acc[..., :G, :]
    mx = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - jnp.where(jnp.isfinite(mx), mx, 0.0))     # -inf partials (empty splits) weigh 0
    den = jnp.sum(w * l, axis=2)
    num = jnp.sum(w[..., None] * acc, axis=2)
    return num / jnp.where(den > 0, den, 1.0)[..., None]


def decode_attention_triton(q, k_cache, v_cache, kv_len, *, scale: float, block_k: int | None = None,
                            num_splits: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None, target_programs: int | None = None,
                            max_splits: int | None = None, interpret: bool = False):
    """One query per sequence over its first kv_len[b] cache rows.

    q [B, Hq, D]; k_cache, v_cache [S, L, Hkv, D], S >= B, row b for query b (Hq % Hkv == 0, D a power of two);
    kv_len [B] int (clamped into [0, L]; 0 gives zeros). Returns [B, Hq, D] in q.dtype."""
    p = _params(dict(block_k=block_k, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                     target_programs=target_programs, max_splits=max_splits))
    B, Hq, D = q.shape
    L, Hkv = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.shape == v_cache.shape and k_cache.shape[0] >= B and k_cache.shape[3] == D
    assert Hq % Hkv == 0 and D == _next_pow2(D)
    G = Hq // Hkv
    Gp = max(MIN_ROWS, _next_pow2(G))
    BK = p["block_k"]
    assert BK == _next_pow2(BK)
    NS = p["num_splits"] or auto_splits(B, Hkv, L, BK, p["target_programs"], p["max_splits"])
    kv_len = jnp.clip(kv_len.astype(jnp.int32), 0, L)
    prec = jax.lax.Precision.HIGHEST if q.dtype == f32 else None
    kern = functools.partial(_kernel, G=G, Gp=Gp, D=D, BK=BK, NS=NS, scale=float(scale), prec=prec)
    m, l, acc = pl.pallas_call(
        kern, grid=(B, Hkv, NS),
        out_shape=(jax.ShapeDtypeStruct((B, Hkv, NS, Gp), f32), jax.ShapeDtypeStruct((B, Hkv, NS, Gp), f32),
                   jax.ShapeDtypeStruct((B, Hkv, NS, Gp, D), f32)),
        compiler_params=plt.CompilerParams(num_warps=p["num_warps"], num_stages=p["num_stages"]),
        interpret=interpret, name="decode_attention",
    )(kv_len, q, k_cache, v_cache)
    return combine_splits(m, l, acc, G).reshape(B, Hq, D).astype(q.dtype)


# ==================================================================================================== prefill
# A first choice (255 registers, no spills on sm_90a). In the engine's packed prefill call (8 prompts, 3,072 rows) the
# kernel made the whole call 72.42 ms against 77.71 with XLA's attention (H200, results/prefill_gdn_2026-12-02b/).
PREFILL_TUNING = {"block_q": 64, "block_k": 64, "num_warps": 8, "num_stages": 2}


def _prefill_kernel(len_ref, q_ref, pos_ref, k_ref, v_ref, o_ref, *, D, BQ, BK, Tq, Tk, rep, scale, prec):
    """Program (sequence b, query head h, query block m): flash attention of BQ query rows over the keys visible to
    the block's last row, online softmax in fp32."""
    b, h, mb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = h // rep
    rows = pl.ds(mb * BQ, BQ)
    qr = mb * BQ + jax.lax.broadcasted_iota(jnp.int32, (BQ,), 0)
    q_live = qr < Tq
    q = plt.load(q_ref.at[b, rows, h, :], mask=jnp.broadcast_to(q_live[:, None], (BQ, D)), other=0)
    pos = plt.load(pos_ref.at[b, rows], mask=q_live, other=-1)                 # [BQ]; -1: sees nothing
    n = jnp.minimum(len_ref[b], jnp.max(pos) + 1)                              # keys any row of the block sees
    kr = jax.lax.broadcasted_iota(jnp.int32, (BK,), 0)

    def body(j, carry):
        m, l, acc = carry
        kidx = j * BK + kr
        live = kidx < jnp.minimum(n, Tk)
        k = plt.load(k_ref.at[b, pl.ds(j * BK, BK), kh, :], mask=jnp.broadcast_to(live[:, None], (BK, D)), other=0)
        v = plt.load(v_ref.at[b, pl.ds(j * BK, BK), kh, :], mask=jnp.broadcast_to(live[:, None], (BK, D)), other=0)
        sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=f32)
        seen = live[None, :] & (kidx[None, :] <= pos[:, None])                  # [BQ, BK]
        sc = jnp.where(seen, sc * scale, -1e30)                                 # finite: m stays finite
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(seen, jnp.exp(sc - m_new[:, None]), 0.0)
        l = alpha * l + jnp.sum(p, axis=1)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                                 preferred_element_type=f32)
        return m_new, l, acc * alpha[:, None] + pv

    init = (jnp.full((BQ,), -1e30, f32), jnp.zeros((BQ,), f32), jnp.zeros((BQ, D), f32))
    _, l, acc = jax.lax.fori_loop(0, (n + BK - 1) // BK, body, init)
    o = acc / jnp.where(l > 0, l, 1.0)[:, None]                                 # no visible key: 0
    plt.store(o_ref.at[b, rows, h, :], o.astype(o_ref.dtype), mask=jnp.broadcast_to(q_live[:, None], (BQ, D)))


def prefill_attention_triton(q, k, v, q_pos, kv_len, *, scale: float, block_q: int | None = None,
                             block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                             interpret: bool = False):
    """Causal GQA attention of many queries per sequence (prefill), flash style: no [Tq, Tk] scores in HBM.

    q [B, Tq, Hq, D] at positions q_pos [B, Tq]; k, v [S, Tk, Hkv, D], S >= B (rows [0, B) are the sequences); key
    j of sequence b is visible to query i iff j <= q_pos[b, i] and j < kv_len[b] (the reference's rule); a query
    with no visible key gives zeros. Each query block walks the key blocks up to its last row's position only.
    Returns [B, Tq, Hq, D] in q.dtype."""
    p = _params(dict(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages), PREFILL_TUNING)
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    assert k.shape == v.shape and k.shape[0] >= B and k.shape[3] == D and Hq % Hkv == 0 and D == _next_pow2(D)
    BQ, BK = p["block_q"], p["block_k"]
    prec = jax.lax.Precision.HIGHEST if q.dtype == f32 else None
    kern = functools.partial(_prefill_kernel, D=D, BQ=BQ, BK=BK, Tq=Tq, Tk=Tk, rep=Hq // Hkv, scale=float(scale),
                             prec=prec)
    return pl.pallas_call(
        kern, grid=(B, Hq, pl.cdiv(Tq, BQ)),
        out_shape=jax.ShapeDtypeStruct((B, Tq, Hq, D), q.dtype),
        compiler_params=plt.CompilerParams(num_warps=p["num_warps"], num_stages=p["num_stages"]),
        interpret=interpret, name="prefill_attention",
    )(kv_len.astype(jnp.int32), q, q_pos.astype(jnp.int32), k, v)
