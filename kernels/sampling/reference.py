"""Sampling rules of Drama 3 in plain jnp: the truth the kernels must reproduce.

Filters are defined on values, not on sort order, so a sort-free kernel reproduces them exactly (ties are kept or
dropped together). With scaled logits z = logits / max(T, 1e-5) and p = softmax(z):
  top-k:                                           keep i iff #{j : z_j > z_i} < k   (k = 0: no top-k)
  top-p keeping the crossing token (main token):   keep i iff sum_{j : z_j > z_i} p_j < top_p
  top-p standard (codebook heads):                 keep i iff sum_{j : z_j >= z_i} p_j <= top_p
  the most likely token is always kept; top_p >= 1 disables top-p (no float round-off at the boundary).
The draw is a Gumbel-max over kept tokens: argmax_i (z_i + G_i), G = jax.random.gumbel(key, (V,)) (one noise value
per vocabulary entry, first index on ties). `gumbel_at(key, i)` computes G_i alone, bit-identical to that array's
element i (threefry2x32 in its "partitionable" counter layout, JAX's default), so a kernel can draw noise only for
the tokens that survive the filters.

Main token with repetition-aware sampling (RAS): a second draw (its own key) with T = 1.0, top-k 30, top-p 0.95
(crossing kept) replaces the first when the first is not EOS (the last candidate) and its token id is in the window of
recent main tokens.

Only the filter/draw math lives here (no model constants beyond MIN_TEMPERATURE); drama3_jax/sampling.py holds the
request-level rules (keys per frame and draw, head top-k cap, RAS window) and calls kernels/sampling/api.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MIN_TEMPERATURE = 1e-5
_TINY = float(np.finfo(np.float32).tiny)


# ------------------------------------------------------------------------------------------------ filters
def scale_logits(logits, temperature):
    """z = logits / max(T, 1e-5) (a true division, per row). logits [B, V], temperature [B]."""
    return logits.astype(jnp.float32) / jnp.maximum(temperature, MIN_TEMPERATURE)[:, None]


def keep_mask(logits, temperature, top_p, top_k, *, keep_crossing: bool):
    """Boolean mask of tokens that survive temperature / top-k / top-p, per row, and the scaled logits.
    logits [B, V] fp32; temperature, top_p [B] float; top_k [B] int (0 = none). Sort-based: the reference."""
    z = scale_logits(logits, temperature)

    def one_row(zr, tp, tk):
        desc = jnp.sort(zr)[::-1]
        ps = jax.nn.softmax(desc)
        cum_excl = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(ps)])  # mass of the first r tokens
        n_greater = jnp.searchsorted(-desc, -zr, side="left")  # tokens strictly above each z_i
        n_geq = jnp.searchsorted(-desc, -zr, side="right")
        keep_p = (cum_excl[n_greater] < tp if keep_crossing else cum_excl[n_geq] <= tp) | (tp >= 1.0)
        keep_k = (tk <= 0) | (n_greater < tk)
        return (keep_p & keep_k) | (n_greater == 0)

    return jax.vmap(one_row)(z, top_p.astype(jnp.float32), top_k), z


def frame_keys(request_keys, frame):
    """Per-row keys of one frame: fold_in(request_key, frame). request_keys [B, 2] uint32, frame [B] int32."""
    return jax.vmap(jax.random.fold_in)(request_keys, frame)


def fold_draw(keys, draw: int):
    """Per-row keys of one draw: fold_in(key, draw) for every row of keys [B, 2] uint32."""
    return jax.vmap(lambda k: jax.random.fold_in(k, draw))(keys)


def draw_keys(request_keys, frame, draw: int):
    """Per-row draw keys fold_in(fold_in(request_key, frame), draw)."""
    return fold_draw(frame_keys(request_keys, frame), draw)


def sample_filtered(keys, logits, temperature, top_p, top_k, *, keep_crossing: bool, draw=None):
    """One draw per row. keys [B, 2] uint32 (raw PRNG keys; with draw, frame keys, and the draw key is
    fold_draw(keys, draw)); returns int32 [B]."""
    if draw is not None:
        keys = fold_draw(keys, draw)
    keep, z = keep_mask(logits, temperature, top_p, top_k, keep_crossing=keep_crossing)
    g = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
    return jnp.argmax(jnp.where(keep, z + g, -jnp.inf), axis=-1).astype(jnp.int32)


def sample_main(keys, ras_keys, band_logits, temperature, top_p, top_k, recent_main, *, semantic_start: int,
                eos_token_id: int, ras_temperature: float, ras_top_k: int, ras_top_p: float, draws=None):
    """Main token with RAS. keys / ras_keys [B, 2] uint32: the first and the RAS draw's keys (with draws = (first,
    RAS) draw ids: keys are frame keys, ras_keys is None, and the draw keys are fold_draw(keys, draws[i]));
    band_logits [B, n] (semantic band then EOS); recent_main [B, W] int32 main-token ids of the last W rows (-1
    padded). Returns main-token ids int32 [B] (semantic_start + band index, or eos_token_id for the last
    candidate)."""
    if draws is not None:
        keys, ras_keys = fold_draw(keys, draws[0]), fold_draw(keys, draws[1])
    B, n = band_logits.shape
    ones = jnp.ones((B,), jnp.float32)
    first = sample_filtered(keys, band_logits, temperature, top_p, top_k, keep_crossing=True)
    second = sample_filtered(ras_keys, band_logits, ras_temperature * ones, ras_top_p * ones,
                             jnp.full((B,), ras_top_k, jnp.int32), keep_crossing=True)
    to_id = lambda i: jnp.where(i == n - 1, eos_token_id, semantic_start + i).astype(jnp.int32)
    first_id = to_id(first)
    repeated = (first < n - 1) & jnp.any(recent_main == first_id[:, None], axis=-1)
    return jnp.where(repeated, to_id(second), first_id)


# ------------------------------------------------------------------------------------------------ noise
_ROT = ((13, 15, 26, 6), (17, 29, 16, 24))


def _rotl(x, d: int):
    return jax.lax.shift_left(x, jnp.uint32(d)) | jax.lax.shift_right_logical(x, jnp.uint32(32 - d))


def threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32 with 20 rounds (Salmon et al. 2011), the hash behind jax.random's default PRNG; uint32 operands
    broadcast together. Written from the published algorithm (rotation schedule and key-schedule parity constant)."""
    k2 = k0 ^ k1 ^ jnp.uint32(0x1BD11BDA)
    ks = (k0, k1, k2)
    x0 = x0 + k0
    x1 = x1 + k1
    for i in range(5):
        for r in _ROT[i % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def uniform_from_bits(bits):
    """jax.random.uniform(minval=tiny, maxval=1) from 32 random bits: 23 mantissa bits -> [1, 2) - 1, then
    f * (1 - tiny) + tiny (1 - tiny rounds to 1 in fp32, so this is f + tiny) and max(tiny, .)."""
    f = jax.lax.bitcast_convert_type(jax.lax.shift_right_logical(bits, jnp.uint32(9)) | jnp.uint32(0x3F800000),
                                     jnp.float32) - 1.0
    return jnp.maximum(jnp.float32(_TINY), f + jnp.float32(_TINY))


def fold_in(k0, k1, data):
    """jax.random.fold_in of a raw key (k0, k1) with uint32 data, bit-identical: threefry2x32 of the counter
    (0, data) under the key (uint32 scalars or arrays that broadcast)."""
    return threefry2x32(k0, k1, jnp.zeros_like(data), data)


def gumbel_at(k0, k1, idx):
    """Element idx of jax.random.gumbel(key, (V,), float32) for a raw key (k0, k1) (uint32 scalars or arrays that
    broadcast with idx), for any V > idx: the counter of element i is the 64-bit (0, i), and the 32 output bits are
    the xor of the two threefry words. idx int32/uint32, < 2**32."""
    b0, b1 = threefry2x32(k0, k1, jnp.zeros_like(idx, jnp.uint32), idx.astype(jnp.uint32))
    return -jnp.log(-jnp.log(uniform_from_bits(b0 ^ b1)))
