"""Sampling rules of Drama 3 (drama3-architecture.md 3.6), batched with per-row parameters.

Filters are defined on values, not on sort order, so a sort-free kernel can reproduce them exactly (ties are kept or
dropped together). With scaled logits z = logits / max(T, 1e-5) and p = softmax(z):
  top-k:                      keep i iff #{j : z_j > z_i} < k   (k = 0: no top-k)
  top-p, keeping the crossing token (main token):  keep i iff sum_{j : z_j > z_i} p_j < top_p
  top-p, standard (codebook heads):               keep i iff sum_{j : z_j >= z_i} p_j <= top_p
  the most likely token is always kept; top_p >= 1 disables top-p (no float round-off at the boundary).
The draw is a Gumbel-max over kept tokens: argmax_i (z_i + G_i), G ~ Gumbel(key), one noise value per vocabulary
entry. Keys are per request: fold_in(fold_in(request_key, frame), draw), draw 0 = main, 1 = RAS re-draw,
2 + i = codebook head i; so a request's samples never depend on the batch it runs in. A decode step derives its
frame keys once (frame_keys) and the kernels fold the draw id in.

Main token: candidates are the semantic band then EOS ([band + 1] logits). Repetition-aware sampling (RAS): a second
draw with T = 1.0, top-k 30, top-p 0.95 (crossing kept) replaces the first when the first is semantic and equals a main
token of the last 16 rows (prompt rows count). Heads: top-k = min(request top-k or 30, 30), standard top-p.

The filter/draw math is kernels/sampling (reference.py is the truth, api.py picks a backend); this module holds the
request-level rules. `backend` ("reference" default, "pallas_triton", "auto") selects the implementation; all are
bit-identical for the same keys.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from kernels.sampling import api as _api
from kernels.sampling.reference import (MIN_TEMPERATURE, draw_keys, frame_keys,  # noqa: F401  (rules: kernels/sampling)
                                       keep_mask)

HEAD_TOP_K_CAP = 30
RAS_WINDOW = 16
RAS_TEMPERATURE, RAS_TOP_K, RAS_TOP_P = 1.0, 30, 0.95
DRAW_MAIN, DRAW_RAS, DRAW_HEAD0 = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling (SGLang-Omni / mlx-audio defaults: T 1.0, top-p 0.9, no top-k on the main token)."""

    temperature: float = 1.0
    top_p: float = 0.9
    top_k: int = 0  # 0 = none; up to the band size. Heads use min(top_k or 30, 30).

    def validate(self, band_size: int) -> "SamplingParams":
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.top_k <= band_size + 1):
            raise ValueError(f"top_k must be in [0, {band_size + 1}], got {self.top_k}")
        return self


def sample_filtered(keys, logits, temperature, top_p, top_k, *, keep_crossing: bool, backend: str = "reference",
                    **backend_kwargs):
    """One draw per row. keys [B, 2] uint32 (raw PRNG keys; or frame keys with draw=, see kernels/sampling/api.py);
    returns int32 [B]."""
    return _api.sample_filtered(keys, logits, temperature, top_p, top_k, keep_crossing=keep_crossing,
                                backend=backend, **backend_kwargs)


def sample_main(fkeys, band_logits, temperature, top_p, top_k, recent_main, *, semantic_start: int, eos_token_id: int,
                backend: str = "reference", **backend_kwargs):
    """Main token with RAS. fkeys [B, 2] uint32: the frame's keys (frame_keys(request_keys, frame)); band_logits
    [B, band + 1] (band then EOS); recent_main [B, W] int32 main-token ids of the last W rows (-1 padded). Returns
    main-token ids int32 [B] (semantic_start + c0, or eos_token_id)."""
    return _api.sample_main(fkeys, None, band_logits, temperature, top_p, top_k, recent_main,
                            semantic_start=semantic_start, eos_token_id=eos_token_id, ras_temperature=RAS_TEMPERATURE,
                            ras_top_k=RAS_TOP_K, ras_top_p=RAS_TOP_P, draws=(DRAW_MAIN, DRAW_RAS), backend=backend,
                            **backend_kwargs)


def head_top_k(top_k):
    """Codebook-head top-k: min(request top-k, 30), 30 when the request has none."""
    return jnp.where(top_k > 0, jnp.minimum(top_k, HEAD_TOP_K_CAP), HEAD_TOP_K_CAP).astype(jnp.int32)


def sample_head(fkeys, head: int, logits, temperature, top_p, top_k, *, backend: str = "reference", **backend_kwargs):
    """Code of codebook head `head` (predicting c_{head+1}). fkeys [B, 2] uint32: the frame's keys; logits [B, V];
    returns int32 [B]."""
    return sample_filtered(fkeys, logits, temperature, top_p, head_top_k(top_k), keep_crossing=False,
                           draw=DRAW_HEAD0 + head, backend=backend, **backend_kwargs)


def push_recent(recent_main, main):
    """Shift the RAS window left and append `main` [B]."""
    return jnp.concatenate([recent_main[:, 1:], main[:, None].astype(recent_main.dtype)], axis=1)


def initial_recent(rows, lengths, window: int = RAS_WINDOW) -> np.ndarray:
    """Host side: main tokens of the last `window` prompt rows per sequence (-1 padded).
    rows [B, T, 1+K], lengths [B] -> int32 [B, window]."""
    rows, lengths = np.asarray(rows), np.asarray(lengths)
    idx = lengths[:, None] - window + np.arange(window)[None, :]
    vals = np.take_along_axis(rows[..., 0], np.clip(idx, 0, rows.shape[1] - 1), axis=1)
    return np.where(idx >= 0, vals, -1).astype(np.int32)
