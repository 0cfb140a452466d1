"""Sort-free filtered sampling as Pallas GPU kernels (Triton lowering), bit-identical to `reference.py`.

One program per row (one distribution); the row stays in registers as an [R, G] tile (R * G = the padded vocabulary,
a power of two; padding lanes are -inf and never kept). Per draw:

  1. z = logits / max(T, 1e-5) (IEEE division, as XLA does; Triton's own fp32 `/` is approximate), the row max m,
     e = exp(z - m), S = sum(e).
  2. A lower bound L on the kept values, so that every kept token has z >= L:
       top-k (1 <= k <= G): L_k = the k-th largest of the G group maxima (group g = lanes g, g + G, g + 2G, ...),
                            by pairwise ranks of the G maxima: at least k tokens are >= L_k, so any token below L_k
                            has k tokens strictly above it (not kept).
       otherwise, top-p < 1: L_p by bisection in value space on [m - D, m], D = log(V / (1 - top_p)) + 1 (tokens more
                            than D below the max hold less than (1 - top_p) / e of the mass, so none is kept):
                            the highest L with mass(z >= L) >= top_p + 1e-5.
  3. Fast path, when n_c = #{z >= L} <= C (the candidate cap): the candidates are compacted in index order through a
     per-row scratch row (prefix sum of the candidate mask, masked scatter, barrier, reload), and the exact rules are
     applied on the [C, C] pairwise comparison of the candidates: rank = #{z_j > z_i}, mass above (> or >=). Every
     token above a candidate is a candidate, so these are the whole-row quantities. Gumbel noise is computed for the
     C candidates only: threefry2x32 on the element's counter (`reference.gumbel_at`), bit-identical to
     jax.random.gumbel(key, (V,))[i] - this is what makes the kernel cheap (the full-row noise of the reference costs
     ~110 integer ops per token).
  4. Fallback (no bound, or more than C candidates: very flat rows, ties, large top-k): exact thresholds by binary
     search over the order-preserving int32 image of z (32 fixed steps, one masked count / mass reduction each; the
     top-k threshold is the largest t with #{key >= t} >= k, the top-p one the smallest t where the mass strictly
     above t (crossing) / at-or-above t (standard) drops below top_p), then noise for the whole row.
  The winner is argmax over kept tokens of z + G, lowest index on ties (as jnp.argmax).

`sample_main_triton` fuses the main token's two draws (RAS): the first draw with the request's parameters; when it is
not EOS and its id is among the recent main tokens, the second draw (RAS parameters, its own key) runs on the same
logits still in registers.

Exactness: the kept set is decided by the same value rules; only the top-p mass sums are added in another order than
the reference's sorted cumsum, so a row whose cumulative mass lies within fp32 round-off (~1e-7 relative) of top_p
can keep one token more or less than the reference. The Gumbel noise is exact (integer hash; the same libdevice
logf as XLA's). Randomness: per-row raw keys [rows, 2] uint32, computed outside (drama3_jax.sampling.draw_keys);
the noise is made inside the kernel from them.

Design notes: threshold search instead of sorting as in tpu-inference's binary_search.py (bit-pattern bisection)
and FlashInfer's sorting-free sampling (pivot search per row); Gumbel-max race as in vLLM's sampler. Tuning values
live in TUNING.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels.sampling.reference import MIN_TEMPERATURE, gumbel_at

f32, i32, u32 = jnp.float32, jnp.int32, jnp.uint32
NEG_INF = float("-inf")
INT_MIN, INT_MAX = -(2 ** 31), 2 ** 31 - 1
P_MARGIN = 1e-5          # top-p bound: keep a little more mass than top_p, so round-off never drops a kept token
P_BISECT_MAX_TOP_P = 0.9999

# Tuning table (data). "rows": generic rows (codebook heads); "main": main token + RAS.
#   groups G: lanes per tile row (the top-k bound uses the k-th largest of G group maxima; top-k <= G for it);
#   cand C: candidate cap of the fast path (pairwise [C, C]); p_bisect: bisection steps of the top-p bound.
TUNING = {
    "rows": {"num_warps": 4, "groups": 128, "cand": 64, "p_bisect": 12},
    "main": {"num_warps": 8, "groups": 128, "cand": 128, "p_bisect": 12},
}


def _params(table: str, overrides: dict) -> dict:
    p = dict(TUNING[table])
    p.update({k: v for k, v in overrides.items() if v is not None})
    return p


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ------------------------------------------------------------------------------------------------ in-kernel helpers
def _div_rn(x, t, interpret: bool):
    """x / t with IEEE round-to-nearest (XLA's fp32 division). Triton lowers fp32 `/` to div.full.f32 (2 ulp)."""
    if interpret:
        return x / t
    (out,) = plt.elementwise_inline_asm("div.rn.f32 $0, $1, $2;", args=[x, jnp.broadcast_to(t, x.shape)],
                                        constraints="=r,r,r", pack=1,
                                        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, f32)])
    return out


def _barrier(interpret: bool):
    """CTA-wide barrier (bar.sync: orders the scratch scatter before the reload). The interpreter runs one program at
    a time, so it needs none."""
    if not interpret:
        plt.debug_barrier()


def _ordered_key(z):
    """Order-preserving int32 image of fp32 values (-0.0 and +0.0 map to the same key)."""
    b = jax.lax.bitcast_convert_type(z, i32)
    k = jnp.where(b < 0, b ^ jnp.int32(INT_MAX), b)
    return jnp.where(z == 0.0, 0, k)


def _avg_floor(lo, hi):
    """floor((lo + hi) / 2) for int32 without overflow."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


def _isum(mask):
    return jnp.sum(mask.astype(i32))


# Pallas-Triton lowering notes (jax 0.11.2), checked by compiling the lowered module to PTX:
#  * a select whose two value operands are both weak-typed Python literals is lowered with the predicate's i1 type,
#    so no jnp.where(pred, 1, 0)-style selects here (one side is always a traced value);
#  * a branch of a cond must not return a literal (return a value computed from an operand instead);
#  * loops have static trip counts (a traced bound hits the select issue above).
def _draw(z, valid, idx, k0, k1, top_p, top_k, *, crossing: bool, row, sz_ref, si_ref, V: int, G: int, C: int,
          NB: int, interpret: bool):
    """One filtered Gumbel-max draw from the [R, G] tile z (already temperature-scaled). Returns (index, slow flag)."""
    zv = jnp.where(valid, z, NEG_INF)
    m = jnp.max(zv)
    e = jnp.where(valid, jnp.exp(zv - m), 0.0)
    S = jnp.sum(e)

    # --- lower bound L on the kept values
    use_k = (top_k > 0) & (top_k <= G)
    gm = jnp.max(zv, axis=0)                                                  # [G] group maxima
    grank = jnp.sum((gm[None, :] > gm[:, None]).astype(i32), axis=1)          # groups strictly above
    L_k = jnp.min(jnp.where(grank < top_k, gm, jnp.inf))
    L_k = jnp.where(use_k, L_k, NEG_INF)

    use_p = jnp.logical_not(use_k) & (top_p <= P_BISECT_MAX_TOP_P)
    target = (top_p + P_MARGIN) * S

    def bisect_step(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        ok = jnp.sum(jnp.where(zv >= mid, e, 0.0)) >= target
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    def bisect():
        D = jnp.log(jnp.float32(V) / jnp.maximum(1.0 - top_p, 1e-6)) + 1.0
        return jax.lax.fori_loop(0, NB, bisect_step, (m - D, m))[0]

    L_p = jax.lax.cond(use_p, bisect, lambda: jnp.minimum(m, NEG_INF))
    L = jnp.maximum(L_k, L_p)
    cand = valid & (zv >= L)
    n_c = _isum(cand)

    def fast():
        ci = cand.astype(i32)
        rowcnt = jnp.sum(ci, axis=1)                                          # [R]
        incl = (jnp.cumsum(rowcnt) - rowcnt)[:, None] + jnp.cumsum(ci, axis=1)  # inclusive prefix count, [R, G]
        # candidates go to [0, n_c) in index order; the others to distinct slots above (masked, never written on GPU;
        # distinct so that the interpreter's read-modify-write of masked lanes cannot clobber a candidate)
        pos = jnp.where(cand, incl - 1, n_c + idx - incl)
        _barrier(interpret)
        plt.store(sz_ref.at[row, pos], zv, mask=cand)
        plt.store(si_ref.at[row, pos], idx, mask=cand)
        _barrier(interpret)
        c = jax.lax.broadcasted_iota(i32, (C,), 0)
        cm = c < n_c
        cz = plt.load(sz_ref.at[row, c], mask=cm, other=NEG_INF)
        cidx = plt.load(si_ref.at[row, c], mask=cm, other=0)
        cp = jnp.where(cm, jnp.exp(cz - m), 0.0) / S
        zi, zj = cz[:, None], cz[None, :]
        gt = zj > zi                                                          # [C, C]: j strictly above i
        rank = jnp.sum(gt.astype(i32), axis=1)
        if crossing:
            keep_p = jnp.sum(jnp.where(gt, cp[None, :], 0.0), axis=1) < top_p
        else:
            keep_p = jnp.sum(jnp.where(zj >= zi, cp[None, :], 0.0), axis=1) <= top_p
        keep_p = keep_p | (top_p >= 1.0)
        keep_k = (top_k <= 0) | (rank < top_k)
        keep = cm & ((keep_p & keep_k) | (cz == m))
        g = gumbel_at(k0, k1, cidx)
        w = jnp.where(keep, cz + g, NEG_INF)
        wmax = jnp.max(w)
        return jnp.min(jnp.where(w == wmax, cidx, INT_MAX))

    def slow():
        key = _ordered_key(zv)
        kmin = jnp.min(jnp.where(valid, key, INT_MAX))
        kmax = jnp.max(jnp.where(valid, key, INT_MIN))
        n_valid = _isum(valid)

        def k_step(_, lohi):        # largest t with #{key >= t} >= k; pred(lo) true, pred(hi) false
            lo, hi = lohi
            mid = _avg_floor(lo, hi)
            ok = _isum(valid & (key >= mid)) >= top_k
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

        use_tk = (top_k > 0) & (top_k < n_valid)
        t_k = jax.lax.cond(use_tk, lambda: jax.lax.fori_loop(0, 32, k_step, (kmin, kmax + 1))[0],
                           lambda: jnp.minimum(kmin, INT_MIN))

        p = e / S

        def p_step(_, lohi):        # smallest t with mass(t) below top_p; pred(lo) false, pred(hi) true
            lo, hi = lohi
            mid = _avg_floor(lo, hi)
            if crossing:
                ok = jnp.sum(jnp.where(valid & (key > mid), p, 0.0)) < top_p
            else:
                ok = jnp.sum(jnp.where(valid & (key >= mid), p, 0.0)) <= top_p
            return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

        use_tp = top_p < 1.0
        init = (kmin - 1, kmax) if crossing else (kmin, kmax + 1)
        t_p = jax.lax.cond(use_tp, lambda: jax.lax.fori_loop(0, 32, p_step, init)[1],
                           lambda: jnp.minimum(kmin, INT_MIN))
        keep = valid & (((key >= t_k) & (key >= t_p)) | (zv == m))
        g = gumbel_at(k0, k1, idx)
        w = jnp.where(keep, zv + g, NEG_INF)
        wmax = jnp.max(w)
        return jnp.min(jnp.where(w == wmax, idx, INT_MAX))

    fast_ok = n_c <= C
    out = jax.lax.cond(fast_ok, fast, slow)
    return out, jnp.logical_not(fast_ok).astype(i32)


def _tile_iota(R: int, G: int):
    return jax.lax.broadcasted_iota(i32, (R, G), 0) * G + jax.lax.broadcasted_iota(i32, (R, G), 1)


def _load_row(x_ref, row, idx, valid):
    return plt.load(x_ref.at[row, idx], mask=valid, other=NEG_INF).astype(f32)


# ------------------------------------------------------------------------------------------------ kernels
def _rows_kernel(x_ref, t_ref, p_ref, k_ref, key_ref, out_ref, path_ref, sz_ref, si_ref, *, V, N, G, C, NB, crossing,
                 interpret):
    row = pl.program_id(0)
    R = N // G
    idx = _tile_iota(R, G)
    valid = idx < V
    x = _load_row(x_ref, row, idx, valid)
    z = _div_rn(x, jnp.maximum(t_ref[row], MIN_TEMPERATURE), interpret)
    out, slow = _draw(z, valid, idx, key_ref[row, 0], key_ref[row, 1], p_ref[row], k_ref[row], crossing=crossing,
                      row=row, sz_ref=sz_ref, si_ref=si_ref, V=V, G=G, C=C, NB=NB, interpret=interpret)
    out_ref[row] = out
    path_ref[row] = slow


def _main_kernel(x_ref, t_ref, p_ref, k_ref, key_ref, key2_ref, recent_ref, out_ref, path_ref, sz_ref, si_ref, *, V,
                 N, G, C, NB, W, semantic_start, eos_token_id, ras_temperature, ras_top_k, ras_top_p, interpret):
    row = pl.program_id(0)
    R = N // G
    idx = _tile_iota(R, G)
    valid = idx < V
    x = _load_row(x_ref, row, idx, valid)
    draw = functools.partial(_draw, crossing=True, row=row, sz_ref=sz_ref, si_ref=si_ref, V=V, G=G, C=C, NB=NB,
                             interpret=interpret)
    z = _div_rn(x, jnp.maximum(t_ref[row], MIN_TEMPERATURE), interpret)
    first, slow1 = draw(z, valid, idx, key_ref[row, 0], key_ref[row, 1], p_ref[row], k_ref[row])
    to_id = lambda i: jnp.where(i == V - 1, eos_token_id, semantic_start + i)
    first_id = to_id(first)
    recent = recent_ref[row, pl.ds(0, W)]
    repeated = (first < V - 1) & (_isum(recent == first_id) > 0)

    def ras():
        z2 = _div_rn(x, jnp.float32(max(ras_temperature, MIN_TEMPERATURE)), interpret)
        second, slow2 = draw(z2, valid, idx, key2_ref[row, 0], key2_ref[row, 1], jnp.float32(ras_top_p),
                             jnp.int32(ras_top_k))
        return to_id(second), 2 + 4 * slow2

    # (a branch of a Triton-lowered cond must not return a literal: `first_id - first_id` is the zero flag)
    out, flags = jax.lax.cond(repeated, ras, lambda: (first_id, first_id - first_id))
    out_ref[row] = out
    path_ref[row] = slow1 + flags


# ------------------------------------------------------------------------------------------------ wrappers
def _geometry(V: int, groups: int):
    N = _next_pow2(V)
    G = min(groups, N)
    return N, G


def _scratch(rows: int, N: int):
    return (jax.ShapeDtypeStruct((rows, N), f32), jax.ShapeDtypeStruct((rows, N), i32))


def sample_filtered_triton(keys, logits, temperature, top_p, top_k, *, keep_crossing: bool, interpret: bool = False,
                           return_path: bool = False, num_warps=None, groups=None, cand=None, p_bisect=None):
    """One filtered Gumbel-max draw per row (see reference.sample_filtered). keys [B, 2] uint32 raw keys; logits [B, V]
    (any float dtype; read once); temperature, top_p [B] float; top_k [B] int. Returns int32 [B] (and, with
    return_path, int32 [B] 1 where the row took the full-row fallback)."""
    cfg = _params("rows", dict(num_warps=num_warps, groups=groups, cand=cand, p_bisect=p_bisect))
    B, V = logits.shape
    N, G = _geometry(V, cfg["groups"])
    C = min(_next_pow2(cfg["cand"]), N)
    kern = functools.partial(_rows_kernel, V=V, N=N, G=G, C=C, NB=cfg["p_bisect"], crossing=keep_crossing,
                             interpret=interpret)
    out, path, _, _ = pl.pallas_call(
        kern, grid=(B,),
        out_shape=(jax.ShapeDtypeStruct((B,), i32), jax.ShapeDtypeStruct((B,), i32)) + _scratch(B, N),
        compiler_params=plt.CompilerParams(num_warps=cfg["num_warps"], num_stages=1),
        interpret=interpret, name="sample_filtered",
    )(logits, temperature.astype(f32), top_p.astype(f32), top_k.astype(i32), keys.astype(u32))
    return (out, path) if return_path else out


def sample_main_triton(keys, ras_keys, band_logits, temperature, top_p, top_k, recent_main, *, semantic_start: int,
                       eos_token_id: int, ras_temperature: float, ras_top_k: int, ras_top_p: float,
                       interpret: bool = False, return_path: bool = False, num_warps=None, groups=None, cand=None,
                       p_bisect=None):
    """Main token with RAS in one launch (see reference.sample_main). recent_main [B, W] int32, W a power of two
    (other widths are padded with -1). With return_path: flags [B] int32, bit 0 first draw took the fallback,
    bit 1 the RAS draw ran, bit 2 the RAS draw took the fallback."""
    cfg = _params("main", dict(num_warps=num_warps, groups=groups, cand=cand, p_bisect=p_bisect))
    B, V = band_logits.shape
    N, G = _geometry(V, cfg["groups"])
    C = min(_next_pow2(cfg["cand"]), N)
    W = recent_main.shape[1]
    Wp = _next_pow2(W)
    if Wp != W:
        recent_main = jnp.pad(recent_main, ((0, 0), (0, Wp - W)), constant_values=-1)
    kern = functools.partial(_main_kernel, V=V, N=N, G=G, C=C, NB=cfg["p_bisect"], W=Wp,
                             semantic_start=int(semantic_start), eos_token_id=int(eos_token_id),
                             ras_temperature=float(ras_temperature), ras_top_k=int(ras_top_k),
                             ras_top_p=float(ras_top_p), interpret=interpret)
    out, path, _, _ = pl.pallas_call(
        kern, grid=(B,),
        out_shape=(jax.ShapeDtypeStruct((B,), i32), jax.ShapeDtypeStruct((B,), i32)) + _scratch(B, N),
        compiler_params=plt.CompilerParams(num_warps=cfg["num_warps"], num_stages=1),
        interpret=interpret, name="sample_main_ras",
    )(band_logits, temperature.astype(f32), top_p.astype(f32), top_k.astype(i32), keys.astype(u32),
      ras_keys.astype(u32), recent_main.astype(i32))
    return (out, path) if return_path else out
