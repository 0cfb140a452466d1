"""Public sampling entry points; `backend` picks the implementation.

Backends:
  "reference"      plain jnp (kernels/sampling/reference.py): sort-based filters, full-row Gumbel noise. The truth.
  "pallas_triton"  sort-free Pallas GPU kernels, Triton lowering (kernels/sampling/pallas_triton.py): one program per
                   row, threshold search instead of a sort, noise only for the surviving candidates; the main token's
                   RAS re-draw is fused into the same launch. Results are bit-identical to the reference for the same
                   keys (see pallas_triton.py for the one round-off caveat at an exact top-p boundary).
  "auto"           "pallas_triton" when JAX's default backend is a GPU, else "reference".

Randomness: callers pass per-row raw keys (uint32 [B, 2]), or one frame's keys with the draw id (`draw=`;
`draws=(first, RAS)` for the main token), and the draw key is fold_in(key, draw) (the Pallas kernels fold it
themselves, bit-identically, the head kernel up to TUNING's fold_rows_max rows; so a decode step needs one XLA op for
its frame keys, not one per draw); the noise of row r is
jax.random.gumbel(key_r, (V,)) in every backend (the kernel computes the elements it needs itself, bit-identically),
so a request's draw never depends on the batch it runs in. Extra keyword arguments (`**backend_kwargs`) go to the
chosen implementation, e.g. `interpret=True` (Pallas interpret mode, for CPU tests) or tuning overrides (`cand=`,
`num_warps=` ...; see pallas_triton.TUNING). Everything stays on device; nothing here syncs with the host.
"""

from __future__ import annotations

from kernels.dispatch import pick_backend
from kernels.sampling import pallas_triton, reference
from kernels.sampling.reference import (MIN_TEMPERATURE, draw_keys, fold_draw, frame_keys, gumbel_at,  # noqa: F401
                                       keep_mask)  # (re-exported)

FILTERED_BACKENDS = {
    "reference": reference.sample_filtered,
    "pallas_triton": pallas_triton.sample_filtered_triton,
}
MAIN_BACKENDS = {
    "reference": reference.sample_main,
    "pallas_triton": pallas_triton.sample_main_triton,
}


def sample_filtered(keys, logits, temperature, top_p, top_k, *, keep_crossing: bool, draw=None,
                    backend: str = "reference", **backend_kwargs):
    """One filtered Gumbel-max draw per row. keys [B, 2] uint32 (draw keys; frame keys with draw); logits [B, V];
    temperature, top_p [B] float; top_k [B] int (0 = none). keep_crossing: top-p keeps the token that crosses top_p
    (main token) or drops it (codebook heads). Returns int32 [B] indices into V."""
    fn = pick_backend(FILTERED_BACKENDS, backend, "sampling", auto="pallas_triton")
    return fn(keys, logits, temperature, top_p, top_k, keep_crossing=keep_crossing, draw=draw,
              **backend_kwargs)


def sample_main(keys, ras_keys, band_logits, temperature, top_p, top_k, recent_main, *, semantic_start: int,
                eos_token_id: int, ras_temperature: float, ras_top_k: int, ras_top_p: float, draws=None,
                backend: str = "reference", **backend_kwargs):
    """Main token with repetition-aware re-sampling. band_logits [B, band + 1] (band then EOS); keys / ras_keys
    [B, 2] uint32 (first and RAS draw; or frame keys, ras_keys None, with draws = (first, RAS) draw ids);
    recent_main [B, W] int32 recent main-token ids (-1 padded). Returns main-token ids int32 [B]:
    semantic_start + band index, or eos_token_id."""
    fn = pick_backend(MAIN_BACKENDS, backend, "sampling", auto="pallas_triton")
    return fn(keys, ras_keys, band_logits, temperature, top_p, top_k, recent_main, semantic_start=semantic_start,
              eos_token_id=eos_token_id, ras_temperature=ras_temperature, ras_top_k=ras_top_k, ras_top_p=ras_top_p,
              draws=draws, **backend_kwargs)
