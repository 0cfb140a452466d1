"""PyTorch restatement of the Drama 3 codebook-MTP tower, written from drama3-architecture.md 3.3 (no caches: a full
causal recompute over the sequence). Reads the tower tensors of OUR safetensors checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.reference.torch_backbone import load_state


class TorchTower:
    def __init__(self, ckpt_dir: str | Path, dtype=torch.float32):
        ckpt_dir = Path(ckpt_dir)
        cfg = json.loads((ckpt_dir / "config.json").read_text())
        self.c, self.a = cfg, cfg["audio_decoder_config"]
        self.w = {k: v.to(dtype) for k, v in load_state(ckpt_dir).items()
                  if k.startswith(("audio_decoder", "audio_decoder_mtp"))}
        self.dtype = dtype

    def norm(self, x, w):
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.a["norm_eps"]) * (1 + w.float())).to(self.dtype)

    def rope(self, x):
        """Interleaved pairs (2i, 2i+1) of the first rot dims; positions 0..T-1. x [B, T, H, D]."""
        rot = int(self.a["head_dim"] * self.a["rotary_percent"])
        T = x.shape[1]
        inv = self.a["rope_base"] ** (-torch.arange(0, rot, 2, dtype=torch.float32) / rot)
        ang = torch.arange(T, dtype=torch.float32)[:, None] * inv  # [T, rot/2]
        cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
        xf = x.float()
        a, b = xf[..., 0:rot:2], xf[..., 1:rot:2]
        out = xf.clone()
        out[..., 0:rot:2] = a * cos - b * sin
        out[..., 1:rot:2] = b * cos + a * sin
        return out.to(self.dtype)

    def attention(self, p, x):
        a = self.a
        nh, nkv, hd = a["n_head"], a["n_local_heads"], a["head_dim"]
        B, T, _ = x.shape
        qkv = x @ self.w[p + "attention.wqkv.weight"].T
        q, g, k, v = torch.split(qkv, [nh * hd, nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = self.rope(self.norm(q.reshape(B, T, nh, hd), self.w[p + "attention.q_norm.weight"]))
        k = self.rope(self.norm(k.reshape(B, T, nkv, hd), self.w[p + "attention.k_norm.weight"]))
        v = v.reshape(B, T, nkv, hd)
        k = k.repeat_interleave(nh // nkv, dim=2)
        v = v.repeat_interleave(nh // nkv, dim=2)
        s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(hd)
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        o = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.float()).reshape(B, T, nh * hd)
        o = o * torch.sigmoid(g.float())
        return o.to(self.dtype) @ self.w[p + "attention.wo.weight"].T

    def layer(self, prefix, emb_name, h, codes, label_sem, extra=None):
        w = self.w
        e = w[prefix + emb_name + ".weight"][codes] * label_sem[..., None]
        if extra is not None:
            e = e + extra
        m = torch.cat([self.norm(e, w[prefix + "enorm.weight"]), self.norm(h, w[prefix + "hnorm.weight"])], -1)
        m = m @ w[prefix + "eh_proj.weight"].T
        t = prefix + "transformer_layer."
        a = m + self.attention(t, self.norm(m, w[t + "attention_norm.weight"]))
        f = self.norm(a, w[t + "ffn_norm.weight"])
        f = a + (torch.nn.functional.silu(f @ w[t + "feed_forward.w1.weight"].T) * (f @ w[t + "feed_forward.w3.weight"].T)) \
            @ w[t + "feed_forward.w2.weight"].T
        return self.norm(f, w[prefix + "final_layernorm.weight"])

    @torch.no_grad()
    def head_logits(self, hidden, rows):
        """hidden [B, T, D] backbone final-norm states of rows [B, T, 1+K]; teacher forcing with rows 1..T-1 as the
        labels. Returns [B, T-1, K-1, V]."""
        a, c = self.a, self.c
        V, K, nb = a["vocab_size"], a["num_codebooks"], a["vq_backbone_codebooks"]
        h = hidden[:, :-1].to(self.dtype)
        inp, lab = rows[:, :-1], rows[:, 1:]
        start, end = c["semantic_start_token_id"], c["semantic_end_token_id"]
        sem_of = lambda r: ((r[..., 0] >= start) & (r[..., 0] <= end)).to(self.dtype)
        label_sem = sem_of(lab)
        c0 = (lab[..., 0] - start).clamp(0, V - 1)
        table = self.w["audio_decoder.codebook_embeddings.weight"]
        extra = sum(table[k * V + inp[..., 1 + k]] for k in range(nb + 1, K)) * sem_of(inp)[..., None]
        for j in range(a["n_layer"]):
            h = self.layer(f"audio_decoder_mtp_shared.layers.{j}.", "semantic_embedding", h, c0, label_sem,
                           extra if j == 0 else None)
        out = []
        for i in range(K - 1):
            h = self.layer(f"audio_decoder_mtp.layers.{i}.", "codebook_embedding", h, lab[..., 1 + i], label_sem)
            out.append((h @ self.w[f"audio_decoder_mtp.heads.{i}.weight"].T).float())
        return torch.stack(out, 2)
