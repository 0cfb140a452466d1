"""PyTorch reference for the backbone: transformers' Qwen3_5MoeForCausalLM loaded from OUR safetensors checkpoint.

Written independently of drama3_jax: it reads the HF-layout files with `safetensors.torch`, dequantises the block-FP8
experts itself, and restates the Drama 3 row embedding (drama3-architecture.md 3.2) in torch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

# If flash-linear-attention were importable the hub wrapper would bind Triton kernels that die on CPU
# (cpu-references.md 1.5): always bind the pure-torch functions.
for _name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
              "causal_conv1d_update"):
    _fn = getattr(hf, _name)
    setattr(hf, _name, getattr(_fn, "__wrapped__", _fn))


def load_state(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    ckpt_dir = Path(ckpt_dir)
    with open(ckpt_dir / "model.safetensors.index.json") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    state = {}
    for s in shards:
        state.update(load_file(ckpt_dir / s))
    return state


def dequant(w: torch.Tensor, scale: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    s = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: w.shape[0], : w.shape[1]]
    return w.float() * s


class TorchBackbone:
    """transformers Qwen3.5-MoE on the Drama 3 checkpoint + the Drama 3 row embedding."""

    def __init__(self, ckpt_dir: str | Path, dtype=torch.float32):
        ckpt_dir = Path(ckpt_dir)
        with open(ckpt_dir / "config.json") as f:
            self.cfg = json.load(f)
        t = self.cfg["text_config"]
        rope = t["rope_parameters"]
        tc = Qwen3_5MoeTextConfig(
            vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_hidden_layers=t["num_hidden_layers"],
            num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"],
            head_dim=t["head_dim"], layer_types=t["layer_types"], rms_norm_eps=t["rms_norm_eps"],
            linear_num_key_heads=t["linear_num_key_heads"], linear_num_value_heads=t["linear_num_value_heads"],
            linear_key_head_dim=t["linear_key_head_dim"], linear_value_head_dim=t["linear_value_head_dim"],
            linear_conv_kernel_dim=t["linear_conv_kernel_dim"], num_experts=t["num_experts"],
            num_experts_per_tok=t["num_experts_per_tok"], moe_intermediate_size=t["moe_intermediate_size"],
            shared_expert_intermediate_size=t["shared_expert_intermediate_size"],
            max_position_embeddings=t["max_position_embeddings"], tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": rope["rope_theta"],
                             "partial_rotary_factor": rope["partial_rotary_factor"]})
        tc._attn_implementation = "eager"
        model = hf.Qwen3_5MoeForCausalLM(tc)
        model.set_experts_implementation("eager")
        raw = {k: v for k, v in load_state(ckpt_dir).items() if not k.startswith("audio_decoder_mtp")}  # tower
        block = tuple(self.cfg.get("quantization_config", {}).get("weight_block_size", (128, 128)))
        sd = {}
        n_exp = t["num_experts"]
        for L in range(t["num_hidden_layers"]):
            pre = f"model.language_model.layers.{L}.mlp.experts."

            def expert(e, proj):
                w = raw.pop(f"{pre}{e}.{proj}.weight")
                s = raw.pop(f"{pre}{e}.{proj}.weight_scale_inv", None)
                return w.float() if s is None else dequant(w, s, block)

            gate_up, down = [], []
            for e in range(n_exp):
                gate_up.append(torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")], 0))
                down.append(expert(e, "down_proj"))
            sd[f"model.layers.{L}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
            sd[f"model.layers.{L}.mlp.experts.down_proj"] = torch.stack(down)
        self.codebook_embeddings = raw.pop("audio_decoder.codebook_embeddings.weight").to(dtype)
        for k, v in raw.items():
            sd[k.replace("model.language_model.", "model.")] = v
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [m for m in missing if "rotary_emb" not in m]
        assert not missing and not unexpected, (missing, unexpected)
        self.model = model.to(dtype).eval()
        self.dtype = dtype

    def embed(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [B, T, 11] -> inputs_embeds (Drama 3 scaled-sum embedding of semantic rows)."""
        c, a = self.cfg, self.cfg["audio_decoder_config"]
        main = rows[..., 0]
        e = self.model.model.embed_tokens(main).float()
        nb, V = a["vq_backbone_codebooks"], a["vocab_size"]
        if nb == 0:
            return e.to(self.dtype)
        sem = (main >= c["semantic_start_token_id"]) & (main <= c["semantic_end_token_id"])
        acc = e.clone()
        for k in range(1, nb + 1):
            acc = acc + self.codebook_embeddings[k * V + rows[..., 1 + k]].float()
        acc = acc / math.sqrt(1 + nb)
        return torch.where(sem[..., None], acc, e).to(self.dtype)

    @torch.no_grad()
    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits [B, T, V] for unpadded rows [B, T, 11]."""
        out = self.model.model(inputs_embeds=self.embed(rows), use_cache=False)
        return self.model.lm_head(out.last_hidden_state).float()

    @torch.no_grad()
    def incremental_logits(self, rows: torch.Tensor, prefill: int) -> torch.Tensor:
        """Prefill `prefill` rows with a cache, then feed the rest one row at a time; logits of all rows."""
        emb = self.embed(rows)
        out = self.model.model(inputs_embeds=emb[:, :prefill], use_cache=True)
        cache, hs = out.cache, [out.last_hidden_state]
        for t in range(prefill, rows.shape[1]):
            out = self.model.model(inputs_embeds=emb[:, t:t + 1], cache=cache, use_cache=True)
            cache = out.cache
            hs.append(out.last_hidden_state)
        return self.model.lm_head(torch.cat(hs, 1)).float()
