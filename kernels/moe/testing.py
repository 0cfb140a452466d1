"""Random inputs for MoE tests and benchmarks (fresh random data, never zeros)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kernels.moe.quant import FP8_MAX
from kernels.moe.weights import ExpertWeights


def quantize_fp8_blocks(w, key, block=(128, 128)):
    """w [E, out, in] fp32 -> (e4m3 values, fp32 scales [E, ceil(out/b0), ceil(in/b1)]) with W ~= q * s per block.
    Scales are absmax-derived times a random factor, so every block has its own, non-trivial scale."""
    E, o, i = w.shape
    b0, b1 = block
    po, pi = -(-o // b0) * b0, -(-i // b1) * b1
    wp = jnp.pad(w, ((0, 0), (0, po - o), (0, pi - i)))
    blocks = wp.reshape(E, po // b0, b0, pi // b1, b1)
    amax = jnp.max(jnp.abs(blocks), axis=(2, 4))
    s = amax / FP8_MAX * jax.random.uniform(key, amax.shape, minval=1.0, maxval=1.5)
    sf = jnp.repeat(jnp.repeat(s, b0, axis=1), b1, axis=2)[:, :o, :i]
    q = (w / sf).astype(jnp.float8_e4m3fn)
    return q, s.astype(jnp.float32)


def random_expert_weights(key, num_experts, hidden, inter, *, fp8: bool, block=(128, 128), scale=1.0):
    """Checkpoint-layout weights: gate/up [E, I, H], down [E, H, I]; bf16, or FP8 e4m3 + fp32 128x128 block scales."""
    ks = jax.random.split(key, 6)
    g = jax.random.normal(ks[0], (num_experts, inter, hidden), jnp.float32) * (scale / np.sqrt(hidden))
    u = jax.random.normal(ks[1], (num_experts, inter, hidden), jnp.float32) * (scale / np.sqrt(hidden))
    d = jax.random.normal(ks[2], (num_experts, hidden, inter), jnp.float32) * (scale / np.sqrt(inter))
    if not fp8:
        return ExpertWeights(g.astype(jnp.bfloat16), u.astype(jnp.bfloat16), d.astype(jnp.bfloat16), block=block)
    (gq, gs), (uq, us), (dq, ds) = (quantize_fp8_blocks(a, k, block) for a, k in zip((g, u, d), ks[3:]))
    return ExpertWeights(gq, uq, dq, gs, us, ds, block=block)


def random_routing(key, tokens, num_experts, top_k, *, only_experts=None, force_expert=None):
    """Router-like ids [T, k] (distinct per token) and renormalised softmax weights [T, k] fp32.

    only_experts: restrict routing to these experts (others get zero tokens);
    force_expert: every token's first choice is this expert (all tokens on one expert)."""
    k1, k2 = jax.random.split(key)
    logits = jax.random.normal(k1, (tokens, num_experts), jnp.float32)
    if only_experts is not None:
        mask = jnp.zeros((num_experts,), bool).at[jnp.asarray(only_experts)].set(True)
        logits = jnp.where(mask, logits, -1e9)
    if force_expert is not None:
        logits = logits.at[:, force_expert].set(1e9)
    _, ids = jax.lax.top_k(logits, top_k)
    w = jax.nn.softmax(jax.random.normal(k2, (tokens, top_k), jnp.float32) * 0.5, axis=-1)
    return ids.astype(jnp.int32), w


def rel_err(out, ref) -> float:
    out = jnp.asarray(out, jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
