"""MoE router top-k in plain jnp: the truth for `kernels/router`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def router_topk_reference(logits, k: int, num_experts: int | None = None):
    """logits [N, E] -> (ids [N, k] int32, weights [N, k] fp32): the k largest logits of each row, largest first (ties:
    the lower expert index first, as `lax.top_k`), and a softmax over those k. Softmax is monotonic and renormalising
    the top-k probabilities cancels the full softmax's denominator, so this equals the checkpoint's rule (softmax over
    all E in fp32, top-k, renormalise) without an [N, E] softmax."""
    if num_experts is not None:
        logits = logits[:, :num_experts]
    top, ids = jax.lax.top_k(logits.astype(jnp.float32), k)
    return ids.astype(jnp.int32), jax.nn.softmax(top, axis=-1)
