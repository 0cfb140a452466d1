"""Sort-free filtered sampling as Pallas GPU kernels (Triton lowering), bit-identical to `reference.py`.

One program per row (one distribution); the row stays in registers as an [R, G] tile (R * G = the padded vocabulary,
a power of two; padding lanes are -inf and never kept). The main token's row (band 4096 + EOS) keeps the band as the
tile and EOS as a scalar "tail" that every reduction adds in, so 4,097 candidates cost 4,096 lanes, not 8,192. Per
draw:

  1. z = logits / max(T, 1e-5) (IEEE division, as XLA does; Triton's own fp32 `/` is approximate), the row max m,
     e = exp(z - m), S = sum(e).
  2. A lower bound L on the kept values, so that every kept token has z >= L:
       top-k (1 <= k <= G): L_k = the k-th largest of the G group maxima (group g = lanes g, g + G, g + 2G, ...),
                            by pairwise ranks of the G maxima: at least k tokens are >= L_k, so any token below L_k
                            has k tokens strictly above it (not kept). When more than C tokens are >= L_k, a few
                            bisection steps in value space raise it while #{z >= L_k} >= k still holds.
       otherwise, top-p < 1: a bracket [lo, hi) by bisection in value space on [m - D, m], D = log(V / (1 - top_p))
                            + 1 (tokens more than D below the max hold less than (1 - top_p) / e of the mass, so none
                            is kept): mass(z >= lo) >= top_p + 1e-5 > mass(z >= hi); L = lo.
  3. Fast path, when n_c = #{z >= L} <= C (the candidate cap): the candidates are compacted in index order through a
     per-row scratch row (prefix count of the candidate mask, masked scatter, barrier, reload), and the exact rules
     are applied on the [C, C] pairwise comparison of the candidates: rank = #{z_j > z_i}, mass above (> or >=).
     Every token above a candidate is a candidate, so these are the whole-row quantities. Gumbel noise is computed
     for the C candidates only: threefry2x32 on the element's counter (`reference.gumbel_at`), bit-identical to
     jax.random.gumbel(key, (V,))[i] - this is what makes the kernel cheap (the full-row noise of the reference costs
     ~110 integer ops per token).
  4. Full-row path (more than C candidates: flat rows with large top-p sets, ties, top-k above G): exact thresholds,
     then noise for the whole row. Top-p: from the bracket, when its band [lo, hi) holds <= C tokens and
     mass(z >= hi) < top_p - 1e-5, every token >= hi is kept and the band tokens are decided pairwise on top of that
     mass (path 1; when mass(z >= hi) is within 1e-5 of top_p, the lowest value >= hi joins the band first, so
     round-off cannot decide it); otherwise a binary search over the order-preserving int32 image of z (32 fixed
     steps, one masked mass reduction each: the smallest t where the mass strictly above t (crossing) / at-or-above
     t (standard) drops below top_p). Top-k: the same search for the largest t with #{key >= t} >= k (path 2 when
     either search ran, else path 1).
  The winner is argmax over kept tokens of z + G, lowest index on ties (as jnp.argmax).

`sample_main_triton` fuses the main token's two draws (RAS): the first draw with the request's parameters; when it is
not EOS and its id is among the recent main tokens, the second draw (RAS parameters, its own key) runs on the same
logits (one loop body of two iterations, so the draw is compiled once).

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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels.sampling.reference import MIN_TEMPERATURE, fold_draw, fold_in, gumbel_at

f32, i32, u32 = jnp.float32, jnp.int32, jnp.uint32
NEG_INF = float("-inf")
INT_MIN, INT_MAX = -(2 ** 31), 2 ** 31 - 1
P_MARGIN = 1e-5          # top-p bound: keep a little more mass than top_p, so round-off never drops a kept token
P_BISECT_MAX_TOP_P = 0.9999

# Tuning table (data). "rows": generic rows (codebook heads); "main": main token + RAS. num_warps from the H200 sweep
# (experiments/results/sampling_summary.md: rows 8 / main 16 warps was the fastest of the four configurations tried,
# 123 us for all 10 samplings at 128 streams, batched).
#   groups G: lanes per tile row (the top-k bound uses the k-th largest of G group maxima; top-k <= G for it);
#   cand C: candidate cap of the fast path (pairwise [C, C]); p_bisect: bisection steps of the top-p bound;
#   p_ways: the ways that search splits its bracket a pass (2: a halving a pass, the default; 4: two halvings from 3
#   independent mass reductions a pass, p_bisect / 2 passes, not yet timed); the bracket decides the path, never the
#   sample;
#   k_bisect: bisection steps that raise a top-k bound leaving more than C candidates (0: such rows take the full-row
#   path, two 32-step searches and the whole row's noise, and a launch lasts as long as its slowest row). For rows
#   whose top values crowd into a few groups (tests); the bench's random head rows did not need it: on the H200 the
#   9 head launches took 58.3 with against 57.6 us without (sampling_2026-12-06b/), no measurable cost;
#   noise_rows: tile rows per chunk of the full-row noise (bounds the hash's registers);
#   noise_cap: the full-row paths draw noise for the kept tokens only, compacted in index order, when at most this
#   many are kept (0: always for the whole row, in noise_rows chunks). Main 512 (one hash per thread at 16 warps):
#   the main launch 26.9 against 27.8 us at 128 rows and 47.7 against 53.1 us at 256 on the H200; heads 0: 256 made
#   the head launch 6.9 against 6.4 us (more registers; the bench's head rows never take a full-row path)
#   (sampling_2026-12-06b/, bench variants "per_head noise_kept" / "batched noise_kept");
#   fold_rows_max (rows only): the draw id is folded in-kernel up to this many rows, by one XLA op first above it (the
#   fold costs registers: 9 head launches of 128 rows were faster folded in-kernel, of 256 rows 130 us against 86 us,
#   experiments/results/sampling_2026-12-02/3_frame_keys);
#   one_wave_groups / one_wave_rows_max (rows only): G for launches of at most that many rows (one program per SM on
#   the H200's 132: the launch lasts one program's latency, and 64 groups shorten it, 9 head launches 58.5 against
#   62.9 us at 128 rows in sampling_2026-12-02/4_fold_threshold), "groups" above (64 groups compile to ~180-210
#   registers against ~128, one CTA per SM instead of two, so 256 rows would take two waves).
TUNING = {
    "rows": {"num_warps": 8, "groups": 128, "cand": 64, "p_bisect": 12, "p_ways": 2, "k_bisect": 8, "noise_rows": 4,
             "noise_cap": 0, "fold_rows_max": 128, "one_wave_groups": 64, "one_wave_rows_max": 132},
    # main cand 64: 30.3 against 32.8 us for the main launch at 128 rows, same call (sampling_2026-12-03/), and 111.1
    # against 114.1 us for the step in sampling_2026-12-02/
    "main": {"num_warps": 16, "groups": 128, "cand": 64, "p_bisect": 12, "p_ways": 2, "k_bisect": 8, "noise_rows": 8,
             "noise_cap": 512},
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


# Pallas-Triton lowering notes (jax 0.11.2), checked by compiling the lowered module to PTX (compile_check.py):
#  * a select whose two value operands are both weak-typed Python literals is lowered with the predicate's i1 type,
#    so no jnp.where(pred, 1, 0)-style selects here (one side is always a traced value);
#  * a branch of a cond must not return a literal (return a value computed from an operand instead);
#  * loops have static trip counts (a traced bound hits the select issue above).
class _Tail(NamedTuple):
    """The main token's last candidate (EOS), held as a scalar beside the tile so that the tile is exactly the
    power-of-two band: the 4,097-candidate row would otherwise pad to 8,192 lanes and double every pass."""
    z: jax.Array        # scaled logit, f32 scalar
    idx: int            # its index in the row (V - 1)


def _count(pred, tile, valid, tail):
    """#{tokens x of the row (tile lanes where valid, and the tail) with pred(x)}."""
    n = _isum(valid & pred(tile))
    return n if tail is None else n + pred(tail).astype(i32)


def _mass(pred, tile, valid, e, tail, tail_e):
    """Sum of e over the tokens of the row with pred(x) (tile lanes where valid, and the tail)."""
    s = jnp.sum(jnp.where(valid & pred(tile), e, 0.0))
    return s if tail is None else s + jnp.where(pred(tail), tail_e, 0.0)


def _compact(mask, n, zv, idx, *, row, sz_ref, si_ref, C: int, interpret: bool, tail=None, tail_in=None,
             rowcnt=None):
    """Values and indices of the `n` <= C selected tokens, in index order, as [C] vectors (-inf / 0 past n), through
    the row's scratch: inclusive prefix count of the tile's `mask` -> masked scatter -> barrier -> reload. With a
    tail, `n` counts it too when `tail_in`; it is the row's last token, so it goes last. `rowcnt` ([R] int32, the
    mask's count per tile row) when the caller has it already."""
    n_tile = n if tail is None else n - tail_in.astype(i32)
    ci = mask.astype(i32)
    rowcnt = jnp.sum(ci, axis=1) if rowcnt is None else rowcnt                # [R]
    incl = (jnp.cumsum(rowcnt) - rowcnt)[:, None] + jnp.cumsum(ci, axis=1)    # inclusive prefix count, [R, G]
    # masked lanes get distinct slots above n_tile: never written on the GPU, and the interpreter's
    # read-modify-write of masked lanes cannot clobber a selected one
    pos = jnp.where(mask, incl - 1, n_tile + idx - incl)
    _barrier(interpret)                       # earlier readers of the scratch row are done
    plt.store(sz_ref.at[row, pos], zv, mask=mask)
    plt.store(si_ref.at[row, pos], idx, mask=mask)
    c = jax.lax.broadcasted_iota(i32, (C,), 0)
    if tail is not None:                      # one lane of a [C] store: slot n_tile (< C when it is selected)
        at = tail_in & (c == n_tile)
        plt.store(sz_ref.at[row, c], jnp.full((C,), tail.z), mask=at)
        plt.store(si_ref.at[row, c], c * 0 + tail.idx, mask=at)
    _barrier(interpret)
    cm = c < n
    cz = plt.load(sz_ref.at[row, c], mask=cm, other=NEG_INF)
    cidx = plt.load(si_ref.at[row, c], mask=cm, other=0)
    return cz, cidx, cm


def _value_bisect(ok, lo, hi, steps: int):
    """`steps` halvings of the fp32 bracket [lo, hi) keeping ok(lo) true and ok(hi) false: (lo, hi)."""
    def step(_, lohi):
        lo_, hi_ = lohi
        mid = 0.5 * (lo_ + hi_)
        good = ok(mid)
        return jnp.where(good, mid, lo_), jnp.where(good, hi_, mid)

    return jax.lax.fori_loop(0, steps, step, (lo, hi))


def _value_split(ok, lo, hi, steps: int, ways: int):
    """The bracket of `steps` halvings in ceil(steps / log2(ways)) passes (ways a power of two >= 4): a pass asks ok
    at the ways - 1 pivots lo + (hi - lo) * j / ways as separate scalar reductions that do not depend on each other,
    so their latencies can overlap (one [P, R, G] reduction compiles to ~10 barriers a halving against 2:
    experiments/results/triton_reduction_cost_2026-12-07/). ok(lo) true and ok(hi) false are kept, as in
    _value_bisect, since ok is non-increasing in the pivot."""
    def step(_, lohi):
        lo_, hi_ = lohi
        new_lo, new_hi = lo_, hi_
        for j in range(1, ways):
            piv = lo_ + (hi_ - lo_) * (j / ways)
            good = ok(piv)
            new_lo = jnp.where(good, jnp.maximum(new_lo, piv), new_lo)
            new_hi = jnp.where(good, new_hi, jnp.minimum(new_hi, piv))
        return new_lo, new_hi

    return jax.lax.fori_loop(0, -(-steps // (ways.bit_length() - 1)), step, (lo, hi))


def _mass_above(cz, cp, base, crossing: bool):
    """base + mass of the listed tokens strictly above (crossing) / at or above (standard) each listed token; [C]."""
    zi, zj = cz[:, None], cz[None, :]
    above = (zj > zi) if crossing else (zj >= zi)
    return base + jnp.sum(jnp.where(above, cp[None, :], 0.0), axis=1)


def _draw(z, valid, idx, tail, k0, k1, top_p, top_k, *, crossing: bool, row, sz_ref, si_ref, V: int, G: int,
          C: int, NB: int, NK: int, interpret: bool, load_z, RC: int, NC: int, PW: int = 2):
    """One filtered Gumbel-max draw from the [R, G] tile z (already temperature-scaled) and, for the main token, the
    scalar tail (_Tail, else None); V counts every token of the row, the tail included. load_z(r0) reloads tile
    rows [r0, r0 + RC) of z (the full-row noise is drawn in such chunks, to bound the registers the hash needs);
    with NC > 0, when at most NC tokens are kept, the noise is drawn for those only, compacted into [NC] vectors.
    Returns (index, path): path 0 = candidate fast path, 1 = full row without a 32-step search (top-p threshold
    from the bisection band, or no threshold), 2 = full row with a 32-step threshold search."""
    zv = jnp.where(valid, z, NEG_INF)
    tz = None if tail is None else tail.z
    gm = jnp.max(zv, axis=0)                                                  # [G] group maxima
    m = jnp.max(gm) if tail is None else jnp.maximum(jnp.max(gm), tz)
    e = jnp.where(valid, jnp.exp(zv - m), 0.0)
    te = None if tail is None else jnp.exp(tz - m)
    S = jnp.sum(e) if tail is None else jnp.sum(e) + te
    mass = lambda pred: _mass(pred, zv, valid, e, tz, te)

    def compact(pred, n, rowcnt=None, C=C):
        return _compact(valid & pred(zv), n, zv, idx, row=row, sz_ref=sz_ref, si_ref=si_ref, C=C,
                        interpret=interpret, tail=tail, tail_in=None if tail is None else pred(tz), rowcnt=rowcnt)

    # --- lower bound L on the kept values (the tile's group maxima alone already give k distinct tokens >= L_k)
    use_k = (top_k > 0) & (top_k <= G)

    def group_bound():      # only with a top-k: the main token's rows mostly have none ([G, G] ranks + a min)
        grank = jnp.sum((gm[None, :] > gm[:, None]).astype(i32), axis=1)      # groups strictly above
        return jnp.min(jnp.where(grank < top_k, gm, jnp.inf))

    L_k = jax.lax.cond(use_k, group_bound, lambda: jnp.minimum(m, NEG_INF))

    # top-p bracket [lo, hi): mass(z >= lo) >= top_p + margin > mass(z >= hi) (no token below lo is kept)
    use_p = jnp.logical_not(use_k) & (top_p <= P_BISECT_MAX_TOP_P)
    target = (top_p + P_MARGIN) * S

    def bisect():
        D = jnp.log(jnp.float32(V) / jnp.maximum(1.0 - top_p, 1e-6)) + 1.0
        ok = lambda mid: mass(lambda x: x >= mid) >= target     # noqa: E731
        return _value_bisect(ok, m - D, m, NB) if PW == 2 else _value_split(ok, m - D, m, NB, PW)

    lo, hi = jax.lax.cond(use_p, bisect, lambda: (jnp.minimum(m, NEG_INF), m))
    L = jnp.maximum(L_k, lo)

    def candidates(L):      # the candidate count per tile row ([R], reused by the compaction's prefix count), total
        c_rows = jnp.sum((valid & (zv >= L)).astype(i32), axis=1)
        return c_rows, jnp.sum(c_rows) if tail is None else jnp.sum(c_rows) + (tz >= L).astype(i32)

    c_rows, n_c = candidates(L)

    # a loose top-k bound (more than C tokens >= L_k, e.g. a few groups holding many of the top values): raise it by
    # bisection in value space on [L_k, m), keeping #{z >= L} >= k, so that any token below L still has k tokens
    # strictly above it; with k <= G this nearly always brings the count to about k, and the row stays on the
    # candidate path instead of two 32-step searches and the full-row noise
    def tighten_k():
        L_t = _value_bisect(lambda mid: _count(lambda x: x >= mid, zv, valid, tz) >= top_k, L, m, NK)[0]
        return (L_t, *candidates(L_t))

    if NK:
        L, c_rows, n_c = jax.lax.cond(use_k & (n_c > C), tighten_k, lambda: (L, c_rows, n_c))

    def fast():
        cz, cidx, cm = compact(lambda x: x >= L, n_c, c_rows)
        cp = jnp.where(cm, jnp.exp(cz - m), 0.0) / S
        rank = jnp.sum((cz[None, :] > cz[:, None]).astype(i32), axis=1)
        above = _mass_above(cz, cp, 0.0, crossing)
        keep_p = ((above < top_p) if crossing else (above <= top_p)) | (top_p >= 1.0)
        keep_k = (top_k <= 0) | (rank < top_k)
        keep = cm & ((keep_p & keep_k) | (cz == m))
        w = jnp.where(keep, cz + gumbel_at(k0, k1, cidx), NEG_INF)
        wmax = jnp.max(w)
        return jnp.min(jnp.where(w == wmax, cidx, INT_MAX)), n_c - n_c

    def slow():
        key = _ordered_key(zv)
        tkey = None if tail is None else _ordered_key(tz)
        kcount = lambda pred: _count(pred, key, valid, tkey)
        kmass = lambda pred: _mass(pred, key, valid, e, tkey, te)
        no_key = jnp.minimum(top_k, INT_MIN)    # INT_MIN from an operand (a cond branch must not return a literal)

        def key_range():    # for the 32-step searches only: two reductions that the band path does not need
            kmin = jnp.min(jnp.where(valid, key, INT_MAX))
            kmax = jnp.max(jnp.where(valid, key, INT_MIN))
            if tail is not None:
                kmin, kmax = jnp.minimum(kmin, tkey), jnp.maximum(kmax, tkey)
            return kmin, kmax

        def k_step(_, lohi):        # largest t with #{key >= t} >= k; pred(lo) true, pred(hi) false
            lo_, hi_ = lohi
            mid = _avg_floor(lo_, hi_)
            ok = kcount(lambda k: k >= mid) >= top_k
            return jnp.where(ok, mid, lo_), jnp.where(ok, hi_, mid)

        use_tk = (top_k > 0) & (top_k < V)

        def k_search():
            kmin, kmax = key_range()
            return jax.lax.fori_loop(0, 32, k_step, (kmin, kmax + 1))[0]

        t_k = jax.lax.cond(use_tk, k_search, lambda: no_key)

        def p_step(_, lohi):        # smallest t with mass(t) below top_p; pred(lo) false, pred(hi) true
            lo_, hi_ = lohi
            mid = _avg_floor(lo_, hi_)
            if crossing:
                ok = kmass(lambda k: k > mid) < top_p * S
            else:
                ok = kmass(lambda k: k >= mid) <= top_p * S
            return jnp.where(ok, lo_, mid), jnp.where(ok, mid, hi_)

        def p_search():
            kmin, kmax = key_range()
            init = (kmin - 1, kmax) if crossing else (kmin, kmax + 1)
            return jax.lax.fori_loop(0, 32, p_step, init)[1]

        # exact top-p threshold from the bracket, in key space: the band is [key(lo), top), top = key(hi); every
        # token at or above top is kept (their mass A < top_p - margin), none below lo is, and the few band tokens
        # are decided pairwise on top of A. When the mass at or above hi lies within the margin of top_p, the lowest
        # value at or above hi joins the band (top = its key + 1), so that round-off cannot decide it.
        top = _ordered_key(hi)
        A0 = kmass(lambda k: k >= top) / S
        ambiguous = use_p & (A0 >= top_p - P_MARGIN)

        def past_lowest_above():    # (one past the lowest key >= top, the mass at that key)
            kh = jnp.min(jnp.where(valid & (key >= top), key, INT_MAX))
            if tail is not None:
                kh = jnp.minimum(kh, jnp.where(tkey >= top, tkey, INT_MAX))
            return kh + 1, kmass(lambda k: k == kh) / S

        top, p_h = jax.lax.cond(ambiguous, past_lowest_above, lambda: (top, A0 - A0))
        A = A0 - p_h
        klo = _ordered_key(lo)
        in_band = lambda k: (k >= klo) & (k < top)
        n_b = kcount(in_band)
        band_ok = use_p & (n_b <= C) & (A < top_p - P_MARGIN)

        def band_threshold():
            bz, _, bm = compact(lambda x: in_band(_ordered_key(x)), n_b)
            bp = jnp.where(bm, jnp.exp(bz - m), 0.0) / S
            above = _mass_above(bz, bp, A, crossing)
            kept = bm & ((above < top_p) if crossing else (above <= top_p))
            return jnp.minimum(jnp.min(jnp.where(kept, _ordered_key(bz), INT_MAX)), top)

        use_tp = top_p < 1.0
        t_p = jax.lax.cond(use_tp, lambda: jax.lax.cond(band_ok, band_threshold, p_search),
                           lambda: no_key)
        t = jnp.maximum(t_k, t_p)

        kept = lambda x: (_ordered_key(x) >= t) | (x == m)   # the row max is always kept

        def noise_chunk(ci, best):      # running (max of z + G over kept tokens, its lowest index)
            zc, vc, ic = load_z(ci * RC)
            zc = jnp.where(vc, zc, NEG_INF)
            keep = vc & kept(zc)
            w = jnp.where(keep, zc + gumbel_at(k0, k1, ic), NEG_INF)
            cmax = jnp.max(w)
            cidx = jnp.min(jnp.where(w == cmax, ic, INT_MAX))
            better = cmax > best[0]     # ties keep the earlier chunk's (lower) index
            return jnp.where(better, cmax, best[0]), jnp.where(better, cidx, best[1])

        def noise_chunked():
            best, out = jax.lax.fori_loop(0, z.shape[0] // RC, noise_chunk, (jnp.minimum(m, NEG_INF), no_key - no_key))
            if tail is not None:        # last index: it wins only when strictly above
                wt = jnp.where(kept(tz), tz + gumbel_at(k0, k1, out * 0 + tail.idx), NEG_INF)
                out = jnp.where(wt > best, out * 0 + tail.idx, out)
            return out

        def noise_compacted():          # the kept tokens in index order, noise for those only
            cz, cidx, _ = compact(kept, n_keep, C=NC)
            w = cz + gumbel_at(k0, k1, cidx)                # -inf past n_keep
            return jnp.min(jnp.where(w == jnp.max(w), cidx, INT_MAX))

        if NC:
            n_keep = _count(kept, zv, valid, tz)
            out = jax.lax.cond(n_keep <= NC, noise_compacted, noise_chunked)
        else:
            out = noise_chunked()
        path = 1 + (use_tk | (use_tp & jnp.logical_not(band_ok))).astype(i32)
        return out, path

    return jax.lax.cond(n_c <= C, fast, slow)


def _tile_iota(R: int, G: int):
    return jax.lax.broadcasted_iota(i32, (R, G), 0) * G + jax.lax.broadcasted_iota(i32, (R, G), 1)


def _tile_valid(idx, n_tile: int):
    """Lanes holding a token (the first n_tile); a constant when the tile is full (no padding lanes)."""
    return jnp.full(idx.shape, True) if n_tile == idx.size else idx < n_tile


def _load_row(x_ref, row, idx, valid):
    return plt.load(x_ref.at[row, idx], mask=valid, other=NEG_INF).astype(f32)


def _load_chunk(x_ref, row, t, r0, *, n_tile, G, RC, interpret):
    """Tile rows [r0, r0 + RC) of the scaled row: (z, valid, idx), each [RC, G] (a re-read, L2-resident)."""
    idx = r0 * G + _tile_iota(RC, G)
    valid = idx < n_tile
    return _div_rn(_load_row(x_ref, row, idx, valid), t, interpret), valid, idx


def _load_tail(x_ref, row, i: int, t, interpret: bool):
    """Scaled logit i of the row as an f32 scalar (through a 2-lane vector: the division's inline asm needs one)."""
    lane = jax.lax.broadcasted_iota(i32, (2,), 0)
    x = plt.load(x_ref.at[row, i + lane], mask=lane == 0, other=NEG_INF).astype(f32)
    return jnp.max(_div_rn(x, t, interpret))


def _draw_key(key_ref, row, draw):
    """Row's draw key: key_ref's raw key, or (draw an int) fold_in(frame key, draw), in-kernel. (Folding the frame
    in here too would need a second hash chain, which raises the head kernel from 115 to 204 registers.)"""
    k0, k1 = key_ref[row, 0], key_ref[row, 1]
    return (k0, k1) if draw is None else fold_in(k0, k1, k0 * 0 + u32(draw))


# ------------------------------------------------------------------------------------------------ kernels
def _rows_kernel(x_ref, t_ref, p_ref, k_ref, key_ref, out_ref, path_ref, sz_ref, si_ref, *, V, N, G, C, NB, NK, RC,
                 NC, PW, crossing, draw, interpret):
    row = pl.program_id(0)
    k0, k1 = _draw_key(key_ref, row, draw)
    idx = _tile_iota(N // G, G)
    valid = _tile_valid(idx, V)
    x = _load_row(x_ref, row, idx, valid)
    t = jnp.maximum(t_ref[row], MIN_TEMPERATURE)
    z = _div_rn(x, t, interpret)
    out, path = _draw(z, valid, idx, None, k0, k1, p_ref[row], k_ref[row],
                      crossing=crossing, row=row, sz_ref=sz_ref, si_ref=si_ref, V=V, G=G, C=C, NB=NB, NK=NK,
                      interpret=interpret, RC=RC, NC=NC, PW=PW,
                      load_z=functools.partial(_load_chunk, x_ref, row, t, n_tile=V, G=G, RC=RC, interpret=interpret))
    out_ref[row] = out
    path_ref[row] = path


def _main_kernel(x_ref, t_ref, p_ref, k_ref, key_ref, key2_ref, recent_ref, out_ref, path_ref, sz_ref, si_ref, *, V,
                 N, G, C, NB, NK, RC, NC, PW, W, semantic_start, eos_token_id, ras_temperature, ras_top_k, ras_top_p,
                 draws, interpret):
    """Draw 0 with the request's parameters; draw 1 (RAS parameters, its own key) only when draw 0 gave a semantic
    token that is in the recent window. One loop body, so the draw is compiled once. The band (V - 1 tokens) is the
    tile, EOS (index V - 1) the scalar tail."""
    row = pl.program_id(0)
    idx = _tile_iota(N // G, G)
    valid = _tile_valid(idx, V - 1)
    recent = recent_ref[row, pl.ds(0, W)]
    t_req = jnp.maximum(t_ref[row], MIN_TEMPERATURE)
    p_req, k_req = p_ref[row], k_ref[row]
    ras_t = jnp.float32(max(ras_temperature, MIN_TEMPERATURE))
    first_draw, ras_draw = draws or (None, None)
    kf0, kf1 = _draw_key(key_ref, row, first_draw)
    kr0, kr1 = _draw_key(key_ref if draws else key2_ref, row, ras_draw)   # with draws: one frame key, folded twice

    def step(d, carry):
        i_prev, id_prev, flags = carry
        first = d == 0
        repeated = (i_prev < V - 1) & (_isum(recent == id_prev) > 0)

        def run():
            t = jnp.where(first, t_req, ras_t)
            tp = jnp.where(first, p_req, jnp.float32(ras_top_p))
            tk = jnp.where(first, k_req, jnp.int32(ras_top_k))
            k0, k1 = jnp.where(first, kf0, kr0), jnp.where(first, kf1, kr1)
            x = _load_row(x_ref, row, idx, valid)      # (re)loaded per draw: not held across the loop
            tail = _Tail(_load_tail(x_ref, row, V - 1, t, interpret), V - 1)
            i, path = _draw(_div_rn(x, t, interpret), valid, idx, tail, k0, k1, tp, tk, crossing=True, row=row,
                            sz_ref=sz_ref, si_ref=si_ref, V=V, G=G, C=C, NB=NB, NK=NK, interpret=interpret, RC=RC,
                            NC=NC, PW=PW,
                            load_z=functools.partial(_load_chunk, x_ref, row, t, n_tile=V - 1, G=G, RC=RC,
                                                     interpret=interpret))
            new_id = jnp.where(i == V - 1, eos_token_id, semantic_start + i)
            return i, new_id, flags + path * (1 + 7 * d) + 4 * d   # bits 0-1 draw 0 path, 2 RAS ran, 3-4 RAS path

        return jax.lax.cond(first | repeated, run, lambda: (i_prev, id_prev, flags))

    zero = key_ref[row, 0].astype(i32) * 0
    _, out, flags = jax.lax.fori_loop(0, 2, step, (zero + (V - 1), zero + eos_token_id, zero))
    out_ref[row] = out
    path_ref[row] = flags


# ------------------------------------------------------------------------------------------------ wrappers
def _geometry(n_tile: int, groups: int):
    N = _next_pow2(n_tile)
    G = min(groups, N)
    return N, G


def _rc(N: int, G: int, cfg: dict) -> int:
    return max(1, min(_next_pow2(cfg["noise_rows"]), N // G))


def _nc(N: int, cfg: dict) -> int:
    return min(_next_pow2(cfg["noise_cap"]), N) if cfg["noise_cap"] else 0


def _ways(cfg: dict) -> int:
    w = cfg["p_ways"]
    if w < 2 or w & (w - 1):
        raise ValueError(f"p_ways must be a power of two >= 2, got {w}")
    return w


def _scratch(rows: int, N: int):
    return (jax.ShapeDtypeStruct((rows, N), f32), jax.ShapeDtypeStruct((rows, N), i32))


def sample_filtered_triton(keys, logits, temperature, top_p, top_k, *, keep_crossing: bool, draw=None,
                           interpret: bool = False, return_path: bool = False, num_warps=None, groups=None, cand=None,
                           p_bisect=None, p_ways=None, k_bisect=None, noise_rows=None, noise_cap=None,
                           fold_rows_max=None):
    """One filtered Gumbel-max draw per row (see reference.sample_filtered). keys [B, 2] uint32 raw keys (frame keys
    with draw: the kernel folds the draw id in); logits [B, V] (any float dtype; read once); temperature,
    top_p [B] float; top_k [B] int. Returns int32 [B] (and, with
    return_path, the path per row, int32 [B]: 0 candidates, 1 full row without a 32-step search, 2 full row with
    one)."""
    cfg = _params("rows", dict(num_warps=num_warps, groups=groups, cand=cand, p_bisect=p_bisect, p_ways=p_ways,
                               k_bisect=k_bisect, noise_rows=noise_rows, noise_cap=noise_cap,
                               fold_rows_max=fold_rows_max))
    B, V = logits.shape
    if draw is not None and B > cfg["fold_rows_max"]:
        keys, draw = fold_draw(keys, draw), None
    if groups is None and B <= cfg["one_wave_rows_max"]:
        cfg["groups"] = cfg["one_wave_groups"]
    N, G = _geometry(V, cfg["groups"])
    C = min(_next_pow2(cfg["cand"]), N)
    kern = functools.partial(_rows_kernel, V=V, N=N, G=G, C=C, NB=cfg["p_bisect"], NK=cfg["k_bisect"],
                             RC=_rc(N, G, cfg), NC=_nc(N, cfg), PW=_ways(cfg), crossing=keep_crossing,
                             draw=None if draw is None else int(draw), interpret=interpret)
    out, path, _, _ = pl.pallas_call(
        kern, grid=(B,),
        out_shape=(jax.ShapeDtypeStruct((B,), i32), jax.ShapeDtypeStruct((B,), i32)) + _scratch(B, N),
        compiler_params=plt.CompilerParams(num_warps=cfg["num_warps"], num_stages=1),
        interpret=interpret, name="sample_filtered",
    )(logits, temperature.astype(f32), top_p.astype(f32), top_k.astype(i32), keys.astype(u32))
    return (out, path) if return_path else out


def sample_main_triton(keys, ras_keys, band_logits, temperature, top_p, top_k, recent_main, *, semantic_start: int,
                       eos_token_id: int, ras_temperature: float, ras_top_k: int, ras_top_p: float, draws=None,
                       interpret: bool = False, return_path: bool = False, num_warps=None, groups=None,
                       cand=None, p_bisect=None, p_ways=None, k_bisect=None, noise_rows=None, noise_cap=None):
    """Main token with RAS in one launch (see reference.sample_main; with draws, keys are frame keys, ras_keys None,
    and the kernel folds both draw ids in). recent_main [B, W] int32 (padded with -1 to a
    power of two). With return_path: flags [B] int32: bits 0-1 the first draw's path (0 candidates, 1 full row without
    a 32-step search, 2 full row with one), bit 2 the RAS draw ran, bits 3-4 its path."""
    cfg = _params("main", dict(num_warps=num_warps, groups=groups, cand=cand, p_bisect=p_bisect, p_ways=p_ways,
                               k_bisect=k_bisect, noise_rows=noise_rows, noise_cap=noise_cap))
    B, V = band_logits.shape
    if V < 2:
        raise ValueError(f"the main token needs a band and EOS (at least 2 candidates), got {V}")
    N, G = _geometry(V - 1, cfg["groups"])     # the tile holds the band; EOS is the scalar tail
    C = min(_next_pow2(cfg["cand"]), N)
    W = recent_main.shape[1]
    Wp = _next_pow2(W)
    if Wp != W:
        recent_main = jnp.pad(recent_main, ((0, 0), (0, Wp - W)), constant_values=-1)
    kern = functools.partial(_main_kernel, V=V, N=N, G=G, C=C, NB=cfg["p_bisect"], NK=cfg["k_bisect"],
                             RC=_rc(N, G, cfg), NC=_nc(N, cfg), PW=_ways(cfg), W=Wp,
                             semantic_start=int(semantic_start), eos_token_id=int(eos_token_id),
                             ras_temperature=float(ras_temperature), ras_top_k=int(ras_top_k),
                             ras_top_p=float(ras_top_p), interpret=interpret,
                             draws=None if draws is None else tuple(int(d) for d in draws))
    if draws is not None:
        ras_keys = keys
    out, path, _, _ = pl.pallas_call(
        kern, grid=(B,),
        out_shape=(jax.ShapeDtypeStruct((B,), i32), jax.ShapeDtypeStruct((B,), i32)) + _scratch(B, N),
        compiler_params=plt.CompilerParams(num_warps=cfg["num_warps"], num_stages=1),
        interpret=interpret, name="sample_main_ras",
    )(band_logits, temperature.astype(f32), top_p.astype(f32), top_k.astype(i32), keys.astype(u32),
      ras_keys.astype(u32), recent_main.astype(i32))
    return (out, path) if return_path else out
