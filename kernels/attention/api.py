"""Public attention entry point; `backend` picks the implementation.

Backends:
  "reference"      plain jnp (kernels/attention/reference.py): reads the whole cache, masks by position. The truth.
  "pallas_triton"  Pallas GPU kernels (kernels/attention/pallas_triton.py). One query per sequence (Tq == 1,
                   decode): the length-aware flash-decoding kernel, which reads only the visible cache rows; its key
                   count is min(kv_len, q_pos + 1) clamped into [0, Tk], exactly the reference's mask (key j visible
                   iff j <= q_pos and j < kv_len) for a single query. Tq > 1 (prefill): the flash prefill kernel
                   (`prefill_attention_triton`: no scores in HBM, each query block walks the keys up to its rows'
                   last position).
  "pallas_triton_decode"  the decode kernel for Tq == 1, the reference (XLA, scores in HBM) for Tq > 1: the
                   ablation of the flash prefill kernel.
  "auto"           "pallas_triton" when JAX's default backend is a GPU, else "reference".

Extra keyword arguments (`**backend_kwargs`) go to the kernel, e.g. `interpret=True` (Pallas interpret mode, for CPU
tests) or tuning overrides (`block_k=`, `num_splits=`, `num_warps=` ...; see pallas_triton.TUNING); the reference
path ignores them.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels.attention.pallas_triton import decode_attention_triton, prefill_attention_triton
from kernels.attention.reference import attention_reference
from kernels.dispatch import pick_backend


def _attention_triton_decode(q, k, v, q_pos, kv_len, *, scale: float, **kernel_kwargs):
    if q.shape[1] != 1:
        return _reference(q, k, v, q_pos, kv_len, scale=scale)
    n = jnp.minimum(kv_len.astype(jnp.int32), q_pos[:, 0].astype(jnp.int32) + 1)
    return decode_attention_triton(q[:, 0], k, v, n, scale=scale, **kernel_kwargs)[:, None]


def _reference(q, k, v, q_pos, kv_len, *, scale: float, **_):
    B = q.shape[0]
    return attention_reference(q, k[:B], v[:B], q_pos, kv_len, scale=scale)


def _attention_triton(q, k, v, q_pos, kv_len, *, scale: float, **kernel_kwargs):
    if q.shape[1] == 1:
        return _attention_triton_decode(q, k, v, q_pos, kv_len, scale=scale, **kernel_kwargs)
    return prefill_attention_triton(q, k, v, q_pos, kv_len, scale=scale, **kernel_kwargs)


BACKENDS = {"reference": _reference, "pallas_triton": _attention_triton,
            "pallas_triton_decode": _attention_triton_decode}


def attention(q, k, v, q_pos, kv_len, *, scale: float, backend: str = "reference", **backend_kwargs):
    """Causal GQA attention: q [B, Tq, Hq, D] at positions q_pos [B, Tq]; k, v [S, Tk, Hkv, D] with S >= B (rows
    [0, B) are sequences 0..B-1: a cache pool read in place); key j of sequence b is visible iff j <= q_pos[b, i]
    and j < kv_len[b]. Softmax in fp32; returns [B, Tq, Hq, D] in q.dtype."""
    fn = pick_backend(BACKENDS, backend, "attention", auto="pallas_triton")
    return fn(q, k, v, q_pos, kv_len, scale=scale, **backend_kwargs)
