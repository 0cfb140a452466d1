"""Sampling rules: exact equality with an independent slow reference, distributions (chi-square), RAS, edge cases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from drama3_jax import sampling as S


def slow_keep(logits, temperature, top_p, top_k, keep_crossing):
    """Per-token loops in float64, straight from the written rules."""
    z = np.asarray(logits, np.float64) / max(temperature, S.MIN_TEMPERATURE)
    p = np.exp(z - z.max())
    p /= p.sum()
    keep = np.zeros(len(z), bool)
    for i in range(len(z)):
        greater = z > z[i]
        ok_p = top_p >= 1.0 or (p[greater].sum() < top_p if keep_crossing else p[z >= z[i]].sum() <= top_p)
        ok_k = top_k <= 0 or greater.sum() < top_k
        keep[i] = (ok_p and ok_k) or not greater.any()
    return keep, z


def slow_sample(key, logits, temperature, top_p, top_k, keep_crossing):
    keep, z = slow_keep(logits, temperature, top_p, top_k, keep_crossing)
    g = np.asarray(jax.random.gumbel(key, (len(z),), jnp.float32), np.float64)
    return int(np.argmax(np.where(keep, z + g, -np.inf)))


def logits_cases(rng, V):
    yield rng.normal(size=V) * 3
    yield np.full(V, 0.7)  # all equal
    yield np.where(np.arange(V) == 5, 40.0, 0.0)  # very peaked
    ties = rng.normal(size=V)
    ties[::3] = ties[0]
    yield ties


@pytest.mark.parametrize("keep_crossing", [True, False])
def test_exact_equality_with_slow_reference(keep_crossing):
    rng = np.random.default_rng(0)
    V = 37
    cases = list(logits_cases(rng, V))
    params = [(1.0, 0.9, 0), (0.7, 0.5, 5), (1e-7, 0.9, 0), (1.3, 1.0, 30), (1.0, 0.05, 0)]
    rows, temps, tps, tks = [], [], [], []
    for c in cases:
        for t, tp, tk in params:
            rows.append(c), temps.append(t), tps.append(tp), tks.append(tk)
    B = len(rows)
    keys = jnp.stack([jax.random.PRNGKey(i) for i in range(B)]).astype(jnp.uint32)
    got = S.sample_filtered(keys, jnp.asarray(np.stack(rows), jnp.float32), jnp.asarray(temps, jnp.float32),
                            jnp.asarray(tps, jnp.float32), jnp.asarray(tks, jnp.int32), keep_crossing=keep_crossing)
    want = [slow_sample(keys[i], np.float32(rows[i]), temps[i], tps[i], tks[i], keep_crossing) for i in range(B)]
    assert np.asarray(got).tolist() == want
    keep, _ = S.keep_mask(jnp.asarray(np.stack(rows), jnp.float32), jnp.asarray(temps, jnp.float32),
                          jnp.asarray(tps, jnp.float32), jnp.asarray(tks, jnp.int32), keep_crossing=keep_crossing)
    for i in range(B):
        np.testing.assert_array_equal(np.asarray(keep[i]), slow_keep(np.float32(rows[i]), temps[i], tps[i], tks[i],
                                                                     keep_crossing)[0])


def test_top_p_crossing_token_kept_for_main_only():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2]], jnp.float32))
    args = (jnp.ones(1), jnp.asarray([0.6]), jnp.zeros(1, jnp.int32))
    main, _ = S.keep_mask(logits, *args, keep_crossing=True)
    head, _ = S.keep_mask(logits, *args, keep_crossing=False)
    assert np.asarray(main[0]).tolist() == [True, True, False]
    assert np.asarray(head[0]).tolist() == [True, False, False]


def _empirical(logits, n, temperature, top_p, top_k, keep_crossing):
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(n)).astype(jnp.uint32)
    L = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    f = jnp.full((n,), 1.0, jnp.float32)
    draws = S.sample_filtered(keys, L, f * temperature, f * top_p, jnp.full((n,), top_k, jnp.int32),
                              keep_crossing=keep_crossing)
    return np.bincount(np.asarray(draws), minlength=len(logits))


@pytest.mark.parametrize("temperature, top_p, top_k, keep_crossing", [
    (1.0, 1.0, 0, True), (0.6, 1.0, 0, True), (1.0, 0.7, 0, True), (1.0, 0.7, 0, False), (1.5, 1.0, 3, False),
    (0.8, 0.8, 4, True)])
def test_distribution_matches_exact_filtered_distribution(temperature, top_p, top_k, keep_crossing):
    logits = np.array([1.2, 0.3, -0.4, 2.0, 0.9, -1.5, 0.0, 0.5], np.float32)
    n = 20000
    counts = _empirical(logits, n, temperature, top_p, top_k, keep_crossing)
    keep, z = slow_keep(logits, temperature, top_p, top_k, keep_crossing)
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    assert counts[~keep].sum() == 0
    stat = chisquare(counts[keep], p[keep] * n)
    assert stat.pvalue > 1e-3, (counts, p * n)


def test_ras_replaces_a_repeated_main_token():
    band, start, eos = 16, 100, 7
    logits = np.zeros((2, band + 1), np.float32)
    logits[:, 3] = 50.0  # the first (T -> 0) draw is surely band index 3
    keys = jnp.stack([jax.random.PRNGKey(1), jax.random.PRNGKey(2)]).astype(jnp.uint32)
    frame = jnp.array([4, 4])
    recent = jnp.array([[-1] * 15 + [start + 3], [-1] * 15 + [start + 9]], jnp.int32)
    out = S.sample_main(S.frame_keys(keys, frame), jnp.asarray(logits), jnp.full((2,), 1e-6), jnp.full((2,), 0.9),
                        jnp.zeros(2, jnp.int32), recent, semantic_start=start, eos_token_id=eos)
    second = S.sample_filtered(S.draw_keys(keys, frame, S.DRAW_RAS), jnp.asarray(logits), jnp.ones(2),
                               jnp.full((2,), 0.95), jnp.full((2,), 30, jnp.int32), keep_crossing=True)
    assert int(out[1]) == start + 3  # not repeated: first draw kept
    want0 = eos if int(second[0]) == band else start + int(second[0])
    assert int(out[0]) == want0
    # EOS is never "repeated": an EOS first draw stands even when EOS is in the window
    logits_eos = np.zeros((1, band + 1), np.float32)
    logits_eos[0, band] = 50.0
    out = S.sample_main(S.frame_keys(keys[:1], frame[:1]), jnp.asarray(logits_eos), jnp.full((1,), 1e-6),
                        jnp.full((1,), 0.9), jnp.zeros(1, jnp.int32), jnp.full((1, 16), eos, jnp.int32),
                        semantic_start=start, eos_token_id=eos)
    assert int(out[0]) == eos


def test_head_top_k_is_capped_at_30():
    assert np.asarray(S.head_top_k(jnp.array([0, 5, 30, 31, 4096]))).tolist() == [30, 5, 30, 30, 30]


def test_per_request_reproducibility_independent_of_batch_order():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 65)).astype(np.float32)
    keys = jnp.stack([jax.random.PRNGKey(s) for s in (5, 6, 7, 8, 9, 10)]).astype(jnp.uint32)
    frame = jnp.array([0, 3, 3, 7, 1, 2])
    args = lambda idx: (S.frame_keys(keys[idx], frame[idx]), 2, jnp.asarray(logits)[idx], jnp.ones(len(idx)),
                        jnp.full((len(idx),), 0.9), jnp.zeros(len(idx), jnp.int32))
    full = np.asarray(S.sample_head(*args(np.arange(6))))
    perm = np.array([4, 2, 0, 5, 1, 3])
    permuted = np.asarray(S.sample_head(*args(perm)))
    np.testing.assert_array_equal(permuted, full[perm])
    alone = [int(S.sample_head(*args(np.array([i])))[0]) for i in range(6)]
    assert alone == full.tolist()


def test_initial_recent_window():
    rows = np.zeros((2, 20, 11), np.int32)
    rows[..., 0] = np.arange(20)[None] + np.array([[0], [100]])
    r = np.asarray(S.initial_recent(jnp.asarray(rows), jnp.array([20, 5])))
    assert r[0].tolist() == list(range(4, 20))
    assert r[1].tolist() == [-1] * 11 + list(range(100, 105))


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        S.SamplingParams(top_p=0.0).validate(4096)
    with pytest.raises(ValueError, match="top_k"):
        S.SamplingParams(top_k=5000).validate(4096)
    with pytest.raises(ValueError, match="temperature"):
        S.SamplingParams(temperature=-1).validate(4096)
