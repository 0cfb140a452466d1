"""The whole Drama 3 talker: backbone + codebook-MTP tower, with the frame-level operations built on them.

A frame row is [main, c0, ..., c_{K-1}]. Predicting frame t+1 from row t (drama3-architecture.md 3.3):
  h_t = backbone final-norm hidden of row t;  main ~ main_logits(h_t);  c0 = main - semantic_start
  tower(h_t, c0, label_sem = main in band, extra = sum_{k>B} E_cb[k V + c_k(row t)] if row t is semantic)
  -> c1..c9;  row t+1 = [main, c0..c9] is fed back to the backbone at position t+1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from drama3_jax.backbone import BackboneCache, Backends, Drama3Backbone, init_cache
from drama3_jax.config import Drama3Config
from drama3_jax.packing import Packing
from drama3_jax.tower import CodeChooser, ResidualStack, SharedStack, TowerCache, init_tower_cache, run_tower


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelCache:
    backbone: BackboneCache
    tower: TowerCache


def init_model_cache(cfg: Drama3Config, slots: int, max_len: int, dtype=jnp.bfloat16, state_dtype=None) -> ModelCache:
    return ModelCache(init_cache(cfg.text, slots, max_len, dtype, state_dtype),
                      init_tower_cache(cfg.tower, slots, max_len, dtype))


class Drama3Model(Drama3Backbone):
    """Module tree = checkpoint tree: `model.language_model`, `lm_head`, `audio_decoder.codebook_embeddings`,
    `audio_decoder_mtp_shared.layers`, `audio_decoder_mtp.{layers, heads}`."""

    def __init__(self, cfg: Drama3Config, *, dtype=jnp.bfloat16, fp8_experts: bool = True):
        super().__init__(cfg, dtype=dtype, fp8_experts=fp8_experts)
        self.audio_decoder_mtp_shared = SharedStack(cfg.tower, dtype)
        self.audio_decoder_mtp = ResidualStack(cfg.tower, dtype)

    def fuse_projections(self):
        """Run every group of projections of one input as one GEMM (FusedLinear): GDN in_proj_{qkv,z,b,a}, attention
        q/k/v, the MoE router with the shared expert's gate/up and gate, the tower FFNs' w1/w3; and the main token's
        band + EOS rows of lm_head as one weight (Drama3Backbone.fuse_projections). A layout change for speed, done
        once after loading (the module tree then no longer mirrors the checkpoint); idempotent."""
        super().fuse_projections()
        for stack in (self.audio_decoder_mtp_shared, self.audio_decoder_mtp):
            for mtp in stack.layers:
                mtp.transformer_layer.feed_forward.fuse_projections()
        return self

    def is_semantic(self, main):
        c = self.cfg
        return (main >= c.semantic_start_token_id) & (main <= c.semantic_end_token_id)

    def semantic_code(self, main):
        """c0 of a main token (clamped into the band for text/EOS tokens)."""
        return jnp.clip(main - self.cfg.semantic_start_token_id, 0, self.cfg.tower.vocab_size - 1).astype(jnp.int32)

    def extra_features(self, rows):
        """rows [..., 1+K] -> fp32 [..., dim]: sum over codebooks k = B+1..K-1 of E_cb[k V + c_k], zero for
        non-semantic rows (the codebooks of the input row that the backbone embedding did not see)."""
        a = self.cfg.tower
        ks = jnp.arange(a.vq_backbone_codebooks + 1, a.num_codebooks)
        idx = ks * a.vocab_size + jnp.clip(rows[..., 1 + ks], 0, a.vocab_size - 1)
        e = jnp.sum(self.audio_decoder.codebook_embeddings(idx).astype(jnp.float32), axis=-2)
        return e * self.is_semantic(rows[..., 0])[..., None].astype(jnp.float32)

    def tower(self, hidden, main, rows, cache: TowerCache, new_lengths, choose_code: CodeChooser, *,
              fresh: bool = False, backends: Backends = Backends(), compute_heads: bool = True,
              packing: Packing | None = None):
        """Tower for predicted frames with main tokens `main` [B, T] from hidden [B, T, H] of input `rows`
        [B, T, 1+K] (or packed prompts [1, N, ...] with `packing`). Returns (c1..c9 [B, T, K-1], head logits
        [B, T, K-1, V] or None, cache)."""
        return run_tower(self.audio_decoder_mtp_shared, self.audio_decoder_mtp, self.cfg.tower, hidden,
                         self.semantic_code(main), self.is_semantic(main), self.extra_features(rows), cache,
                         new_lengths, choose_code, fresh=fresh, backend=backends.attention,
                         compute_heads=compute_heads, dense=backends.dense, norm=backends.tower_norm,
                         packing=packing, append=backends.append_attention)

    def teacher_forced(self, rows, lengths, max_len: int, *, backends: Backends = Backends(),
                       compute_heads: bool = True, cache_dtype=None):
        """Prefill a batch of prompts: backbone over rows 0..n-1, tower over rows 0..n-2 with rows 1..n-1 as labels.

        rows [B, T, 1+K] right-padded, lengths [B] (>= 2). Returns (hidden [B, T, H], head logits
        [B, T-1, K-1, V] or None, ModelCache with backbone length n and tower length n-1)."""
        B, T = rows.shape[:2]
        dtype = cache_dtype or self.lm_head.weight[...].dtype
        cache = init_model_cache(self.cfg, B, max_len, dtype)
        hidden, bcache = self.forward(rows, cache.backbone, lengths, fresh=True, backends=backends)
        labels = rows[:, 1:]
        _, logits, tcache = self.tower(hidden[:, :-1], labels[..., 0], rows[:, :-1], cache.tower, lengths - 1,
                                       lambda i, _: labels[..., 2 + i], fresh=True, backends=backends,
                                       compute_heads=compute_heads)
        return hidden, logits, ModelCache(bcache, tcache)
