"""Codebook-MTP tower ("audio decoder"): 4 shared + 9 residual MTP layers and 9 codebook heads.

Checkpoint tree: `audio_decoder_mtp_shared.layers.{j}` (j < n_layer, embedding `semantic_embedding`),
`audio_decoder_mtp.layers.{i}` (i < K-1, embedding `codebook_embedding`), `audio_decoder_mtp.heads.{i}`; the shared
codebook table `audio_decoder.codebook_embeddings` lives with the backbone (it also feeds semantic rows).

One MTP layer, input hidden h and code c (drama3-architecture.md 3.3):
  e = Emb[c] * label_is_semantic (+ extra, first shared layer only)
  m = eh_proj([enorm(e), hnorm(h)]);  a = m + wo(attn(attention_norm(m)) * sigmoid(gate))
  f = a + w2(silu(w1(ffn_norm(a))) * w3(ffn_norm(a)));  out = final_layernorm(f)
Attention: fused wqkv rows [all Q | all gates | K | V]; zero-centred q/k norms; interleaved (GPT-J pair) RoPE on the
first head_dim*rotary_percent dims; GQA causal over the layer's own KV cache, which spans the whole sequence at the
backbone row positions. All norms are zero-centred RMSNorm (1 + w).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from drama3_jax.config import TowerConfig
from drama3_jax.nn import Embedding, FusedLinear, Linear, RMSNorm, gated_cached_attention, swiglu
from drama3_jax.packing import Packing
from kernels.append_attention.api import HeadLayout, append_decode_attention
from kernels.rope import apply_rope_interleaved


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TowerCache:
    """k/v: one [S, max_len, n_kv, head_dim] per tower layer (shared first, then residual); lengths [S] int32."""

    k: list
    v: list
    lengths: jax.Array


def init_tower_cache(cfg: TowerConfig, slots: int, max_len: int, dtype=jnp.bfloat16) -> TowerCache:
    kv = lambda: jnp.zeros((slots, max_len, cfg.n_local_heads, cfg.head_dim), dtype)
    return TowerCache(k=[kv() for _ in range(cfg.num_layers)], v=[kv() for _ in range(cfg.num_layers)],
                      lengths=jnp.zeros((slots,), jnp.int32))


class TowerAttention(nnx.Module):
    def __init__(self, cfg: TowerConfig, dtype):
        nh, nkv, hd = cfg.n_head, cfg.n_local_heads, cfg.head_dim
        self.wqkv = Linear(cfg.dim, 2 * nh * hd + 2 * nkv * hd, dtype=dtype)
        self.wo = Linear(nh * hd, cfg.dim, dtype=dtype)
        self.q_norm = RMSNorm(hd, cfg.norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, cfg.norm_eps, dtype=dtype)
        self.cfg = cfg

    def __call__(self, x, positions, k_cache, v_cache, start, new_lengths, *, fresh: bool, backend: str,
                 dense: str = "reference", packing: Packing | None = None, append: str = "reference"):
        """`append`: a kernel backend of kernels/append_attention for decode rows (T == 1), or "reference"."""
        cfg = self.cfg
        nh, nkv, hd = cfg.n_head, cfg.n_local_heads, cfg.head_dim
        if append != "reference" and x.shape[1] == 1 and not fresh and packing is None:
            layout = HeadLayout(nh, nkv, hd, q0=0, q_step=1, gate0=nh, gate_step=1, k0=2 * nh, v0=2 * nh + nkv)
            o, k_cache, v_cache = append_decode_attention(
                self.wqkv(x[:, 0], dense), self.q_norm.weight[...], self.k_norm.weight[...], k_cache, v_cache, start,
                new_lengths, layout=layout, rotary_dim=cfg.rotary_dim, rope_theta=cfg.rope_base,
                rope_style="interleaved", eps=cfg.norm_eps, zero_centered=self.q_norm.zero_centered, backend=append)
            return self.wo(o[:, None], dense), k_cache, v_cache
        qkv = self.wqkv(x, dense)
        if packing is not None:  # packed prompts (drama3_jax/packing.py): attention per prompt
            qkv = packing.to_seqs(qkv)
        B, T = qkv.shape[:2]
        q = qkv[..., :nh * hd].reshape(B, T, nh, hd)
        gate = qkv[..., nh * hd:2 * nh * hd]
        k = qkv[..., 2 * nh * hd:2 * nh * hd + nkv * hd].reshape(B, T, nkv, hd)
        v = qkv[..., 2 * nh * hd + nkv * hd:].reshape(B, T, nkv, hd)
        q = apply_rope_interleaved(self.q_norm(q), positions, cfg.rotary_dim, cfg.rope_base)
        k = apply_rope_interleaved(self.k_norm(k), positions, cfg.rotary_dim, cfg.rope_base)
        o, k_cache, v_cache = gated_cached_attention(q, k, v, gate, positions, k_cache, v_cache, start, new_lengths,
                                                     fresh=fresh, backend=backend)
        if packing is not None:
            o = packing.to_rows(o)
        return self.wo(o, dense), k_cache, v_cache


class FeedForward(nnx.Module):
    def __init__(self, cfg: TowerConfig, dtype):
        self.w1 = Linear(cfg.dim, cfg.intermediate_size, dtype=dtype)
        self.w3 = Linear(cfg.dim, cfg.intermediate_size, dtype=dtype)
        self.w2 = Linear(cfg.intermediate_size, cfg.dim, dtype=dtype)
        self.w13 = None  # FusedLinear(w1, w3) after fuse_projections()

    def fuse_projections(self):
        if self.w13 is not None:
            return
        self.w13 = nnx.data(FusedLinear([self.w1, self.w3]))
        del self.w1, self.w3

    def __call__(self, x, dense: str = "reference"):
        g, u = self.w13(x, dense) if self.w13 is not None else (self.w1(x, dense), self.w3(x, dense))
        return self.w2(swiglu(g, u), dense)


class TransformerLayer(nnx.Module):
    def __init__(self, cfg: TowerConfig, dtype):
        self.attention = TowerAttention(cfg, dtype)
        self.feed_forward = FeedForward(cfg, dtype)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype)


class MTPLayer(nnx.Module):
    """One MTP block; `embedding_name` is `semantic_embedding` (shared layers) or `codebook_embedding`."""

    def __init__(self, cfg: TowerConfig, embedding_name: str, dtype):
        setattr(self, embedding_name, Embedding(cfg.vocab_size, cfg.dim, dtype=dtype))
        self.embedding_name = embedding_name
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype)
        self.eh_proj = Linear(2 * cfg.dim, cfg.dim, dtype=dtype)
        self.final_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype)
        self.transformer_layer = TransformerLayer(cfg, dtype)

    def embed(self, codes, label_sem, extra=None):
        """codes [B, T] -> e [B, T, dim] fp32, zeroed where the predicted frame is not semantic (+ extra)."""
        e = getattr(self, self.embedding_name)(codes).astype(jnp.float32) * label_sem[..., None]
        return e if extra is None else e + extra

    def __call__(self, h, e, positions, k_cache, v_cache, start, new_lengths, *, fresh: bool, backend: str,
                 dense: str = "reference", norm: str = "reference", packing: Packing | None = None,
                 append: str = "reference"):
        """`norm`: "reference" (XLA's adds and norms) or a norm-kernel backend for the two residual add + norm
        pairs (Backends.tower_norm); `append`: TowerAttention's."""
        t = self.transformer_layer
        m = self.eh_proj(jnp.concatenate([self.enorm(e.astype(h.dtype)), self.hnorm(h)], axis=-1), dense)
        o, k_cache, v_cache = t.attention(t.attention_norm(m), positions, k_cache, v_cache, start, new_lengths,
                                          fresh=fresh, backend=backend, dense=dense, packing=packing, append=append)
        if norm == "reference":
            a = m + o
            f = a + t.feed_forward(t.ffn_norm(a), dense)
            return self.final_layernorm(f), k_cache, v_cache
        a, n, _ = t.ffn_norm.with_residual(m, o, norm)
        _, out, _ = self.final_layernorm.with_residual(a, t.feed_forward(n, dense), norm)
        return out, k_cache, v_cache


class SharedStack(nnx.Module):
    def __init__(self, cfg: TowerConfig, dtype):
        self.layers = nnx.List([MTPLayer(cfg, "semantic_embedding", dtype) for _ in range(cfg.n_layer)])


class ResidualStack(nnx.Module):
    def __init__(self, cfg: TowerConfig, dtype):
        self.layers = nnx.List([MTPLayer(cfg, "codebook_embedding", dtype) for _ in range(cfg.num_residual_layers)])
        self.heads = nnx.List([Linear(cfg.dim, cfg.vocab_size, dtype=dtype) for _ in range(cfg.num_residual_layers)])


# chooses the code fed to residual layer i+1 from head i's logits (fp32 [B, T, V]); returns int32 [B, T]
CodeChooser = Callable[[int, jax.Array], jax.Array]


def run_tower(shared: SharedStack, residual: ResidualStack, cfg: TowerConfig, h, c0, label_sem, extra,
              cache: TowerCache, new_lengths, choose_code: CodeChooser, *, fresh: bool, backend: str = "reference",
              compute_heads: bool = True, dense: str = "reference", norm: str = "reference",
              packing: Packing | None = None, append: str = "reference"):
    """Run the 13 tower layers at positions cache.lengths + t.

    h [B, T, dim] backbone final-norm hidden of rows t; c0 [B, T] semantic code of the predicted frame;
    label_sem [B, T] bool (predicted frame is semantic); extra [B, T, dim] fp32 (input-row codebooks the backbone did
    not see). `choose_code(i, logits_i)` gives code c_{i+1} (teacher label or a sample). Returns
    (codes [B, T, K-1] int32 = c1..c9, head logits [B, T, K-1, V] fp32 or None, updated cache). `backend` is the
    attention backend, `dense` the projections' (kernels/dense), `norm` the residual add + norms' (MTPLayer), `append`
    the decode attention's (TowerAttention). With
    `packing`, h, c0, label_sem and extra are packed prompts [1, N, ...] and cache / new_lengths are per prompt (see
    Drama3Backbone.forward)."""
    B, T = (packing.num_seqs, packing.seq_len) if packing is not None else h.shape[:2]
    start = cache.lengths[:B]  # the cache may be a slot pool with more rows (see Drama3Backbone.forward)
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    sem = label_sem.astype(jnp.float32)
    ks, vs = list(cache.k), list(cache.v)
    x = h
    for j, layer in enumerate(shared.layers):
        e = layer.embed(c0, sem, extra if j == 0 else None)
        x, ks[j], vs[j] = layer(x, e, positions, ks[j], vs[j], start, new_lengths, fresh=fresh, backend=backend,
                                dense=dense, norm=norm, packing=packing, append=append)
    code = c0
    codes, logits = [], []
    n = cfg.n_layer
    for i, (layer, head) in enumerate(zip(residual.layers, residual.heads)):
        x, ks[n + i], vs[n + i] = layer(x, layer.embed(code, sem), positions, ks[n + i], vs[n + i], start,
                                        new_lengths, fresh=fresh, backend=backend, dense=dense, norm=norm,
                                        packing=packing, append=append)
        with jax.named_scope("tower_heads"):
            li = head(x, dense).astype(jnp.float32) if compute_heads else None
        code = choose_code(i, li).astype(jnp.int32)
        codes.append(code)
        if compute_heads:
            logits.append(li)
    new_cache = TowerCache(k=ks, v=vs, lengths=cache.lengths.at[:B].set(start + new_lengths.astype(jnp.int32)))
    head_logits = jnp.stack(logits, axis=2) if compute_heads else None
    return jnp.stack(codes, axis=-1), head_logits, new_cache
