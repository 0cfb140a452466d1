"""Sort-free sampling kernels (Pallas, Triton lowering) vs the reference rules, in Pallas interpret mode on CPU.

* exact equality of the sampled indices with kernels/sampling/reference.py for the same keys, over random logits and
  the edge cases (ties incl. -0.0/+0.0, all-equal, very peaked, -inf entries, temperature ~0, top-p 1 / tiny,
  top-k 1 / above the group count / above V), both top-p modes, both kernel paths (candidate fast path and the
  full-row fallback; the kernel reports which one each row took), and one full-size main-token case (V = 4097);
* the main-token kernel with RAS (repeats, EOS never repeated, the window) vs reference.sample_main;
* chi-square agreement of kernel draws with the exact filtered distribution (float64);
* per-request reproducibility: a row's draw does not depend on the other rows of the batch or their order;
* the in-kernel noise (threefry) is bit-identical to jax.random.gumbel;
* drama3_jax.sampling's backend switch, and lowering at full Drama 3 shapes for an (abstract) H200.
Each jitted configuration compiles once (the interpreter's compile dominates the run time).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from drama3_jax import sampling as S
from kernels.dispatch import pick_backend
from kernels.h200_lowering import lower_for_h200
from kernels.sampling import api, pallas_triton, reference
from tests.test_sampling import slow_keep

f32, i32, u32 = jnp.float32, jnp.int32, jnp.uint32
B_ROWS, V_ROWS = 48, 300      # rows kernel test shape: padded to 512 lanes = 4 x 128 groups, candidate cap 64


@functools.lru_cache(maxsize=None)
def _rows_fn(crossing: bool, **kw):
    return jax.jit(functools.partial(pallas_triton.sample_filtered_triton, keep_crossing=crossing, interpret=True,
                                     return_path=True, **kw))


@functools.lru_cache(maxsize=None)
def _ref_rows_fn(crossing: bool):
    return jax.jit(functools.partial(reference.sample_filtered, keep_crossing=crossing))


@functools.lru_cache(maxsize=None)
def _main_fn(backend: str, semantic_start: int, eos: int, **tuning):
    kw = dict(interpret=True, return_path=True, **tuning) if backend == "pallas_triton" else {}
    return jax.jit(functools.partial(api.sample_main, semantic_start=semantic_start, eos_token_id=eos,
                                     ras_temperature=S.RAS_TEMPERATURE, ras_top_k=S.RAS_TOP_K,
                                     ras_top_p=S.RAS_TOP_P, backend=backend, **kw))


def _keys(seeds):
    return jnp.stack([jax.random.fold_in(jax.random.PRNGKey(int(s)), 11) for s in seeds]).astype(u32)


def _edge_rows(rng, V):
    """Logit rows covering the edge cases; every row is paired with several parameter sets below."""
    ties = rng.normal(size=V).astype(np.float32)
    ties[::3] = ties[0]
    ties[1::7] = ties[4]
    zeros = rng.normal(size=V).astype(np.float32)
    zeros[::5] = 0.0
    zeros[2::5] = -0.0
    neg_inf = (rng.normal(size=V) * 2).astype(np.float32)
    neg_inf[rng.choice(V, V // 3, replace=False)] = -np.inf
    return [
        (rng.normal(size=V) * 3).astype(np.float32),
        (rng.normal(size=V) * 0.3).astype(np.float32),            # flat: top-p keeps many
        np.full(V, 0.7, np.float32),                                # all equal
        np.where(np.arange(V) == 5, 40.0, 0.0).astype(np.float32),  # very peaked (ties below the peak)
        ties, zeros, neg_inf,
        np.round(rng.normal(size=V) * 2, 1).astype(np.float32),   # many ties everywhere
    ]


# (temperature, top_p, top_k)
PARAMS = [(1.0, 0.9, 0), (0.7, 0.5, 5), (1e-7, 0.9, 0), (1.3, 1.0, 30), (1.0, 0.05, 0), (1.0, 1.0, 0),
          (0.9, 0.8, 1), (1.1, 0.95, 200), (1.0, 0.7, 5000), (0.5, 1.0, 64)]


def _rows_batch(rng):
    rows = _edge_rows(rng, V_ROWS)
    cases = [(r, *p) for r in rows for p in PARAMS]
    pick = rng.choice(len(cases), B_ROWS, replace=False)
    logits = np.stack([cases[i][0] for i in pick])
    T, P, K = (np.array([cases[i][j] for i in pick]) for j in (1, 2, 3))
    return jnp.asarray(logits), jnp.asarray(T, f32), jnp.asarray(P, f32), jnp.asarray(K, i32)


# ------------------------------------------------------------------------------------------------ noise
def test_gumbel_at_is_bit_identical_to_jax_random():
    at = jax.jit(reference.gumbel_at)
    full = jax.jit(lambda k: jax.random.gumbel(k, (4097,), f32))
    for s in range(4):
        key = jax.random.fold_in(jax.random.PRNGKey(s), 1000 + s)
        want = np.asarray(full(key))
        np.testing.assert_array_equal(np.asarray(at(key[0], key[1], jnp.arange(4097))), want)
        # any subset of indices, in any order; the array length does not enter
        idx = np.random.default_rng(s).permutation(4097)[:37]
        np.testing.assert_array_equal(np.asarray(at(key[0], key[1], jnp.asarray(idx))), want[idx])
        np.testing.assert_array_equal(np.asarray(jax.random.gumbel(key, (37,), f32)),
                                      np.asarray(at(key[0], key[1], jnp.arange(37))))


# ------------------------------------------------------------------------------------------------ exact equality
# groups None: the one-wave default (64 groups at 48 rows); noise_cap 256: the full-row paths draw noise for the kept
# tokens only when at most 256 are kept (most full-row rows here), else for the whole row; None: the default (0,
# always the whole row); p_ways 4: the top-p bracket from three mass reductions a pass (None: bisection)
@pytest.mark.parametrize("groups,noise_cap,p_ways", [(None, 256, 4), (128, None, None)])
def test_rows_kernel_equals_reference_both_modes_both_paths(groups, noise_cap, p_ways):
    rng = np.random.default_rng(1)
    seen_paths = set()
    for crossing in (True, False):
        logits, T, P, K = _rows_batch(rng)
        keys = _keys(rng.integers(0, 2 ** 31, B_ROWS))
        got, path = _rows_fn(crossing, groups=groups, noise_cap=noise_cap, p_ways=p_ways)(keys, logits, T, P, K)
        want = _ref_rows_fn(crossing)(keys, logits, T, P, K)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        seen_paths |= set(np.asarray(path).tolist())
    assert seen_paths == {0, 1, 2}, seen_paths     # candidates, full row without / with a 32-step search


def test_rows_kernel_tightens_a_loose_top_k_bound_onto_the_candidate_path():
    """Rows whose top values crowd into a few of the 64 groups: more than C = 64 tokens lie above the k-th largest
    group maximum, so the group bound alone would send every row to the full-row path; the value bisection raises
    the bound and the rows take the candidate path, with the reference's draws."""
    rng = np.random.default_rng(7)
    G, C = 64, 64                                     # the one-wave geometry at 48 rows (see the test above)
    crowded = (np.arange(V_ROWS) % G) < 16            # 16 groups x 5 lanes hold the 80 largest values
    logits = rng.normal(size=(B_ROWS, V_ROWS)) + np.where(crowded, 6.0, 0.0) * rng.uniform(0.8, 1.2, (B_ROWS, 1))
    logits = jnp.asarray(logits, f32)
    T = jnp.asarray(rng.uniform(0.5, 1.5, B_ROWS), f32)
    P = jnp.asarray(rng.choice([0.5, 0.9, 1.0], B_ROWS), f32)
    K = jnp.asarray(rng.choice([17, 24, 30], B_ROWS), i32)   # above the 16 crowded groups, within the heads' <= 30
    z = np.asarray(logits) / np.asarray(T)[:, None]
    gmax = np.stack([z[:, np.arange(V_ROWS) % G == g].max(axis=1) for g in range(G)], axis=1)
    L_k = -np.sort(-gmax, axis=1)[np.arange(B_ROWS), np.asarray(K) - 1]
    assert ((z >= L_k[:, None]).sum(axis=1) > C).all()     # the group bound is loose on every row
    for crossing in (True, False):
        keys = _keys(rng.integers(0, 2 ** 31, B_ROWS))
        got, path = _rows_fn(crossing, groups=None, noise_cap=256, p_ways=4)(keys, logits, T, P, K)  # compiled above
        np.testing.assert_array_equal(np.asarray(got), np.asarray(_ref_rows_fn(crossing)(keys, logits, T, P, K)))
        assert (np.asarray(path) == 0).all(), path


# noise_cap 0: the whole row's noise (with the top-p bracket from three reductions a pass, p_ways 4); None: the
# defaults (kept tokens' noise up to 512, bisection)
@pytest.mark.parametrize("tuning", [dict(noise_cap=0, p_ways=4), {}])
def test_main_kernel_full_band_equals_reference(tuning):
    """Full size: band 4096 (the tile) + EOS (the scalar tail), realistic and degenerate rows, RAS on a few."""
    rng = np.random.default_rng(3)
    V, B, start, eos = 4097, 8, 151678, 151645
    rows = [rng.normal(size=V) * 2.5, rng.normal(size=V) * 0.2, np.full(V, 1.0), rng.normal(size=V) * 4,
            np.where(np.arange(V) == V - 1, 30.0, rng.normal(size=V)), rng.normal(size=V) * 3,
            np.round(rng.normal(size=V), 1), rng.normal(size=V) * 6]
    logits = jnp.asarray(np.stack(rows), f32)
    T = jnp.asarray([1.0, 1.0, 0.8, 0.6, 1.0, 1e-6, 1.2, 1.0], f32)
    P = jnp.asarray([0.9, 0.9, 0.9, 0.8, 0.9, 0.9, 1.0, 0.99], f32)
    K = jnp.asarray([0, 0, 0, 0, 50, 0, 4096, 0], i32)
    keys, ras_keys = _keys(range(B)), _keys(range(100, 100 + B))
    # windows: row 5 (T ~ 0) repeats its argmax for sure; others random ids from the band
    recent = rng.integers(start, start + V - 1, (B, 16)).astype(np.int32)
    recent[5, 3] = start + int(np.argmax(rows[5]))
    recent[4, :] = eos
    args = (keys, ras_keys, logits, T, P, K, jnp.asarray(recent))
    got, path = _main_fn("pallas_triton", start, eos, **tuning)(*args)
    want = _main_fn("reference", start, eos)(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    path = np.asarray(path)
    assert path[5] & 4                                  # RAS re-draw ran (and matched)
    assert {0, 1, 2} <= set((path & 3).tolist()), path  # all three paths of the first draw were used
    assert (path[:2] & 3 == 1).all()   # flat rows, top-p 0.9, no top-k: exact threshold from the bisection band


def test_main_kernel_eos_tail_equals_reference():
    """EOS (the last candidate) is a scalar beside the band's tile: it must take part in every rule exactly as a tile
    token, whether it is the maximum, tied with it, inside the top-p band, below every threshold or -inf; with a
    full tile (band 256) and with padding lanes (band 255), all three paths of the first draw, RAS on."""
    rng = np.random.default_rng(8)
    start, eos, B = 1000, 7, 48
    for band in (256, 255):
        V = band + 1
        rows = _edge_rows(rng, V)
        cases = [(r, *p) for r in rows for p in PARAMS]
        pick = rng.choice(len(cases), B, replace=False)
        logits = np.stack([cases[i][0] for i in pick]).copy()
        body = logits[:, :band]
        finite_max = np.where(np.isfinite(body), body, -np.inf).max(axis=1)
        where = np.arange(B) % 6
        logits[:, band] = np.select(
            [where == 0, where == 1, where == 2, where == 3, where == 4],
            [finite_max, finite_max + 1.0, np.median(body, axis=1), -np.inf, np.quantile(body, 0.95, axis=1)],
            logits[:, band])
        T, P, K = (jnp.asarray(np.array([cases[i][j] for i in pick]), dt) for j, dt in ((1, f32), (2, f32), (3, i32)))
        K = jnp.minimum(K, V)
        recent = rng.integers(start, start + band, (B, 16)).astype(np.int32)
        recent[::3, 0] = start + np.argmax(body[::3], axis=1)      # some first draws repeat: RAS
        args = (_keys(rng.integers(0, 2 ** 31, B)), _keys(rng.integers(0, 2 ** 31, B)), jnp.asarray(logits), T, P,
                K, jnp.asarray(recent))
        got, path = _main_fn("pallas_triton", start, eos)(*args)
        want = _main_fn("reference", start, eos)(*args)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        path = np.asarray(path)
        assert {0, 1, 2} <= set((path & 3).tolist()), path
        assert (path & 4).any()
        assert (np.asarray(got) == eos).any()


def _bisection_mass_at_hi(z, top_p, steps):
    """numpy replica of the kernel's top-p bracket (fp32): mass(z >= hi) / S after `steps` bisection steps."""
    m = z.max()
    e = np.exp(z - m)
    S = e.sum(dtype=np.float32)
    lo, hi = np.float32(m - (np.log(len(z) / (1 - top_p)) + 1)), np.float32(m)
    for _ in range(steps):
        mid = np.float32(0.5 * (lo + hi))
        lo, hi = (mid, hi) if e[z >= mid].sum(dtype=np.float32) >= (top_p + pallas_triton.P_MARGIN) * S else (lo, mid)
    return e[z >= hi].sum(dtype=np.float32) / S, (z >= lo).sum()


def test_main_kernel_mass_at_the_bracket_edge_keeps_the_band_path():
    """Rows whose mass at or above the bracket's upper end lies within the top-p margin (about 5% of flat rows at
    top-p 0.9) take the band path with the lowest token above the bracket added to the band, not the 32-step
    search, and still equal the reference."""
    rng = np.random.default_rng(9)
    V, top_p, start, eos = 4097, 0.9, 1000, 7
    steps = pallas_triton.TUNING["main"]["p_bisect"]
    rows = []
    while len(rows) < 4:
        z = (rng.normal(size=V) * 2.5).astype(np.float32)
        A, n_lo = _bisection_mass_at_hi(z, top_p, steps)
        if n_lo > pallas_triton.TUNING["main"]["cand"] and A >= top_p - pallas_triton.P_MARGIN:
            rows.append(z)
    B = len(rows)
    ones = jnp.ones((B,), f32)
    args = (_keys(range(B)), _keys(range(50, 50 + B)), jnp.asarray(np.stack(rows)), ones, ones * top_p,
            jnp.zeros((B,), i32), jnp.full((B, 16), -1, i32))
    got, path = _main_fn("pallas_triton", start, eos)(*args)
    want = _main_fn("reference", start, eos)(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert (np.asarray(path) & 3 == 1).all(), path


def test_split_search_keeps_a_valid_bracket_as_narrow_as_the_bisection():
    """The top-p bracket's two searches on random rows' mass predicates: ok(lo) and not ok(hi) hold, and the bracket
    of p_ways 4 / 8 (separate reductions a pass) is as narrow as the 12 halvings of the bisection."""
    rng = np.random.default_rng(12)
    for _ in range(20):
        z = jnp.asarray(rng.normal(size=4096) * rng.uniform(0.3, 5.0), f32)
        e = jnp.exp(z - z.max())
        target = rng.uniform(0.05, 0.99) * e.sum()
        ok = lambda mid: jnp.sum(jnp.where(z >= mid, e, 0.0)) >= target   # noqa: E731
        lo0, hi0 = z.min(), z.max() + 1e-3                          # ok(lo0) and not ok(hi0), as in the kernel
        width = (hi0 - lo0) / 2 ** 12
        split = functools.partial(pallas_triton._value_split, ok, lo0, hi0, 12)
        for lo, hi in (pallas_triton._value_bisect(ok, lo0, hi0, 12), split(4), split(8)):
            assert bool(ok(lo)) and not bool(ok(hi)) and lo < hi
            assert float(hi - lo) <= float(width) * 1.01, (float(hi - lo), float(width))   # fp32 pivots: ulps


def test_main_token_ras_through_drama3_sampling():
    """drama3_jax.sampling.sample_main (the frame's keys; the kernel folds the draw ids in) through the kernel backend
    equals the default (reference) backend; RAS replaces repeats, EOS never counts as repeated."""
    rng = np.random.default_rng(4)
    band, start, eos, B = 16, 100, 7, 32
    logits = rng.normal(size=(B, band + 1)).astype(np.float32) * 2
    logits[:4, 3] = logits[:4].max(axis=1) + 0.5   # first draw (T ~ 0) = band index 3, not dominant at T = 1
    logits[4:6, band] = 50.0                        # sure EOS first draw
    recent = rng.integers(start, start + band, (B, 16)).astype(np.int32)
    recent[rng.random((B, 16)) < 0.3] = -1
    recent[:2, -1] = start + 3                      # repeated -> RAS
    recent[2:4] = -1                                # not repeated -> first draw stands
    recent[4:6] = eos                               # EOS never counts as repeated
    T = jnp.asarray(np.where(np.arange(B) < 6, 1e-6, rng.uniform(0.5, 1.5, B)), f32)
    P = jnp.asarray(rng.choice([0.9, 1.0, 0.5], B), f32)
    K = jnp.asarray(rng.choice([0, 3, 20], B), i32)
    req = _keys(rng.integers(0, 2 ** 31, B))
    frame = jnp.asarray(rng.integers(0, 1000, B), i32)
    args = (S.frame_keys(req, frame), jnp.asarray(logits), T, P, K, jnp.asarray(recent))
    kw = dict(semantic_start=start, eos_token_id=eos)
    got, path = jax.jit(functools.partial(S.sample_main, backend="pallas_triton", interpret=True, return_path=True,
                                          **kw))(*args)
    want = jax.jit(functools.partial(S.sample_main, **kw))(*args)
    got, path = np.asarray(got), np.asarray(path)
    np.testing.assert_array_equal(got, np.asarray(want))
    assert (path[:2] & 4).all() and not (path[2:6] & 4).any()
    assert (got[2:4] == start + 3).all() and (got[4:6] == eos).all()
    assert (path[6:] & 4).any()                     # random repeats were re-drawn too


def test_sample_head_forwards_to_the_chosen_backend(monkeypatch):
    """drama3_jax.sampling.sample_head: the frame keys with the head's draw id (folded by the backend), head top-k
    cap, standard top-p, and the backend keyword reach the api unchanged."""
    calls = {}

    def spy(keys, logits, temperature, top_p, top_k, *, keep_crossing, draw, **kw):
        calls.update(keys=keys, draw=draw, top_k=top_k, keep_crossing=keep_crossing, kw=kw)
        return jnp.zeros((logits.shape[0],), i32)

    monkeypatch.setitem(api.FILTERED_BACKENDS, "pallas_triton", spy)
    fkeys = S.frame_keys(_keys(range(3)), jnp.asarray([0, 5, 9], i32))
    S.sample_head(fkeys, 4, jnp.zeros((3, 8), f32), jnp.ones(3), jnp.ones(3) * 0.9, jnp.asarray([0, 7, 99]),
                  backend="pallas_triton", cand=16)
    np.testing.assert_array_equal(np.asarray(calls["keys"]), np.asarray(fkeys))
    assert calls["draw"] == S.DRAW_HEAD0 + 4
    assert np.asarray(calls["top_k"]).tolist() == [30, 7, 30]
    assert calls["keep_crossing"] is False and calls["kw"] == {"cand": 16}


def test_in_kernel_draw_folding_equals_folding_outside():
    """Frame keys folded with the draw id inside the kernels give the same draws as keys folded by jax.random.fold_in
    first (reference.fold_in is bit-identical to it), for the head and the main kernel; the frame keys are
    fold_in(request key, frame), so draw keys stay fold_in(fold_in(request key, frame), draw)."""
    rng = np.random.default_rng(10)
    req = _keys(rng.integers(0, 2 ** 31, B_ROWS))
    frame = jnp.asarray(rng.integers(0, 2 ** 31 - 1, B_ROWS), i32)
    fkeys = S.frame_keys(req, frame)
    for d in (0, 7, 123456):
        want = S.draw_keys(req, frame, d)
        np.testing.assert_array_equal(np.asarray(api.fold_draw(fkeys, d)), np.asarray(want))
        got = jax.vmap(lambda k: jnp.stack(reference.fold_in(k[0], k[1], jnp.uint32(d))))(fkeys)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    logits, T, P, K = _rows_batch(rng)
    folded = jax.jit(functools.partial(pallas_triton.sample_filtered_triton, keep_crossing=False, draw=5,
                                       interpret=True))(fkeys, logits, T, P, K)
    outside = _rows_fn(False)(S.draw_keys(req, frame, 5), logits, T, P, K)[0]
    np.testing.assert_array_equal(np.asarray(folded), np.asarray(outside))
    by_xla = jax.jit(functools.partial(pallas_triton.sample_filtered_triton, keep_crossing=False, draw=5,
                                       fold_rows_max=B_ROWS - 1, interpret=True))(fkeys, logits, T, P, K)
    np.testing.assert_array_equal(np.asarray(by_xla), np.asarray(outside))   # above fold_rows_max: XLA folds
    main_logits = jnp.asarray(rng.normal(size=(B_ROWS, 33)) * 2, f32)
    recent = jnp.asarray(rng.integers(100, 132, (B_ROWS, 16)), i32)
    kw = dict(semantic_start=100, eos_token_id=7, ras_temperature=S.RAS_TEMPERATURE, ras_top_k=S.RAS_TOP_K,
              ras_top_p=S.RAS_TOP_P, interpret=True, return_path=True)
    main_in, path = jax.jit(functools.partial(pallas_triton.sample_main_triton, draws=(0, 1), **kw))(
        fkeys, None, main_logits, T, P, K, recent)
    main_out, _ = jax.jit(functools.partial(pallas_triton.sample_main_triton, **kw))(
        S.draw_keys(req, frame, 0), S.draw_keys(req, frame, 1), main_logits, T, P, K, recent)
    np.testing.assert_array_equal(np.asarray(main_in), np.asarray(main_out))
    assert (np.asarray(path) & 4).any()       # some RAS draws ran, with the second folded key


# ------------------------------------------------------------------------------------------------ statistics
def test_kernel_draws_follow_the_exact_filtered_distribution():
    rng = np.random.default_rng(5)
    base = np.full(V_ROWS, -30.0, np.float32)
    hot = rng.choice(V_ROWS, 9, replace=False)
    base[hot] = np.array([1.2, 0.3, -0.4, 2.0, 0.9, -1.5, 0.0, 0.5, 1.6], np.float32)
    n_calls = 60
    for crossing, (T, tp, tk) in ((True, (1.0, 0.75, 0)), (False, (0.8, 0.9, 5)), (False, (1.5, 1.0, 0))):
        logits = jnp.broadcast_to(jnp.asarray(base), (B_ROWS, V_ROWS))
        ones = jnp.ones((B_ROWS,), f32)
        counts = np.zeros(V_ROWS, np.int64)
        for c in range(n_calls):
            keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(B_ROWS) + c * B_ROWS).astype(u32)
            got, _ = _rows_fn(crossing)(keys, logits, ones * T, ones * tp, jnp.full((B_ROWS,), tk, i32))
            counts += np.bincount(np.asarray(got), minlength=V_ROWS)
        keep, z = slow_keep(base, T, tp, tk, crossing)
        q = np.where(keep, np.exp(z - z.max()), 0.0)
        q /= q.sum()
        n = n_calls * B_ROWS
        assert counts[~keep].sum() == 0
        assert keep.sum() >= 3
        stat = chisquare(counts[keep], q[keep] * n)
        assert stat.pvalue > 1e-3, (counts[keep], q[keep] * n)


# ------------------------------------------------------------------------------------------------ reproducibility
def test_per_request_draws_do_not_depend_on_the_batch():
    rng = np.random.default_rng(6)
    logits, T, P, K = _rows_batch(rng)
    keys = _keys(rng.integers(0, 2 ** 31, B_ROWS))
    full, _ = _rows_fn(False)(keys, logits, T, P, K)
    perm = rng.permutation(B_ROWS)
    permuted, _ = _rows_fn(False)(keys[perm], logits[perm], T[perm], P[perm], K[perm])
    np.testing.assert_array_equal(np.asarray(permuted), np.asarray(full)[perm])
    # the first half of the batch replaced by other requests: the second half's draws stay the same
    other, oT, oP, oK = _rows_batch(np.random.default_rng(7))
    h = B_ROWS // 2
    mix = lambda a, b: jnp.concatenate([b[:h], a[h:]])
    mixed, _ = _rows_fn(False)(mix(keys, _keys(range(B_ROWS))), mix(logits, other), mix(T, oT), mix(P, oP),
                               mix(K, oK))
    np.testing.assert_array_equal(np.asarray(mixed)[h:], np.asarray(full)[h:])


def test_api_dispatch():
    assert jax.default_backend() == "cpu"
    pick = lambda table, name: pick_backend(table, name, "sampling", auto="pallas_triton")
    assert pick(api.FILTERED_BACKENDS, "auto") is reference.sample_filtered
    assert pick(api.MAIN_BACKENDS, "pallas_triton") is pallas_triton.sample_main_triton
    try:
        pick(api.FILTERED_BACKENDS, "nope")
    except ValueError as e:
        assert "unknown sampling backend" in str(e) and "auto" in str(e)
    else:
        raise AssertionError("no error for an unknown backend")


# ------------------------------------------------------------------------------------------------ lowering
def test_triton_lowering_full_shapes_for_h200():
    """Both kernels lower to one Triton custom call each at Drama 3 shapes (128 streams: main 4097 + RAS window 16,
    9 x 128 head rows of 4096) for an abstract H200, with and without the kept tokens' compacted noise."""
    sd = jax.ShapeDtypeStruct
    B, H = 128, 9
    rows = lower_for_h200(functools.partial(pallas_triton.sample_filtered_triton, keep_crossing=False),
                          sd((B * H, 2), u32), sd((B * H, 4096), f32), sd((B * H,), f32), sd((B * H,), f32),
                          sd((B * H,), i32))
    folded = lower_for_h200(functools.partial(pallas_triton.sample_filtered_triton, keep_crossing=False, draw=3,
                                              noise_cap=256),
                            sd((B, 2), u32), sd((B, 4096), f32), sd((B,), f32), sd((B,), f32), sd((B,), i32))
    main = lower_for_h200(functools.partial(pallas_triton.sample_main_triton, semantic_start=151678,
                                            eos_token_id=151645, ras_temperature=1.0, ras_top_k=30, ras_top_p=0.95,
                                            noise_cap=512),
                          sd((B, 2), u32), sd((B, 2), u32), sd((B, 4097), f32), sd((B,), f32), sd((B,), f32),
                          sd((B,), i32), sd((B, 16), i32))
    for txt in (rows, folded, main):
        assert txt.count("__gpu$xla.gpu.triton") == 1
