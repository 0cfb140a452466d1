"""One validated config object for Drama 3, read from the checkpoint's own `config.json`.

`Drama3Config.from_dict(json.load(...))` accepts the real `fish_omni` layout (nested `text_config` and
`audio_decoder_config`, `quantization_config`, semantic band ids, eos id). Values the public record does not fix
(tower FFN width, `vq_backbone_codebooks`, token ids, ...) are always read from the file; the `full` preset only
carries documented placeholders for them so speed tests can run without the real checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
STATE_DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A config value this implementation does not support, with the offending key named."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """Backbone (Qwen3.5-MoE text model as used by Drama 3, `fish_omni_text`)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    max_position_embeddings: int
    # Recurrent (GDN) state dtype; Qwen3.5 ships float32 (`mamba_ssm_dtype`).
    ssm_state_dtype: str = "float32"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    def validate(self) -> None:
        _require(len(self.layer_types) == self.num_hidden_layers,
                 f"text_config.layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        _require(not bad, f"text_config.layer_types: unsupported layer type(s) {bad}")
        full = self.full_attention_layers
        _require(len(full) > 0, "text_config.layer_types: no full_attention layer")
        interval = full[0] + 1
        expected = tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                         for i in range(self.num_hidden_layers))
        _require(self.layer_types == expected,
                 f"text_config.layer_types is not periodic (one full_attention layer every {interval})")
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 "text_config: num_attention_heads must be a multiple of num_key_value_heads")
        _require(self.linear_num_value_heads % self.linear_num_key_heads == 0,
                 "text_config: linear_num_value_heads must be a multiple of linear_num_key_heads")
        _require(0 < self.partial_rotary_factor <= 1 and self.rotary_dim % 2 == 0,
                 f"text_config.partial_rotary_factor={self.partial_rotary_factor} gives an odd/empty rotary dim")
        _require(1 <= self.num_experts_per_tok <= self.num_experts,
                 "text_config: num_experts_per_tok must be in [1, num_experts]")
        _require(self.linear_conv_kernel_dim >= 2, "text_config.linear_conv_kernel_dim must be >= 2")
        _require(self.ssm_state_dtype in STATE_DTYPES,
                 f"text_config.mamba_ssm_dtype={self.ssm_state_dtype!r}: expected one of {STATE_DTYPES}")


@dataclasses.dataclass(frozen=True)
class TowerConfig:
    """Codebook-MTP tower (`audio_decoder_config`, `fish_qwen3_audio_decoder`)."""

    dim: int
    n_head: int
    n_local_heads: int
    head_dim: int
    n_layer: int  # shared enrichment layers (4 in Drama 3)
    num_codebooks: int  # 10; residual layers = num_codebooks - 1
    vocab_size: int  # per-codebook vocabulary (4096), equals the semantic band size
    intermediate_size: int
    rope_base: float
    rotary_percent: float
    norm_eps: float
    vq_backbone_codebooks: int  # B: codebooks 1..B enter the backbone embedding
    vq_feature_placement: str

    @property
    def num_residual_layers(self) -> int:
        return self.num_codebooks - 1

    @property
    def num_layers(self) -> int:
        return self.n_layer + self.num_residual_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_percent)

    def validate(self) -> None:
        _require(self.n_head % self.n_local_heads == 0,
                 "audio_decoder_config: n_head must be a multiple of n_local_heads")
        _require(self.num_codebooks >= 2, "audio_decoder_config.num_codebooks must be >= 2")
        _require(self.rotary_dim % 2 == 0 and self.rotary_dim > 0,
                 "audio_decoder_config.rotary_percent gives an odd/empty rotary dim")
        if self.vq_feature_placement == "backbone_partial":
            _require(1 <= self.vq_backbone_codebooks <= self.num_codebooks - 1,
                     "audio_decoder_config: vq_feature_placement=backbone_partial needs "
                     f"1 <= vq_backbone_codebooks <= {self.num_codebooks - 1}")
        elif self.vq_feature_placement == "mtp_shared_pre":
            _require(self.vq_backbone_codebooks == 0,
                     "audio_decoder_config: vq_feature_placement=mtp_shared_pre needs vq_backbone_codebooks == 0")
        else:
            raise ConfigError(f"audio_decoder_config.vq_feature_placement={self.vq_feature_placement!r} is not supported")


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """`quantization_config` of the routed experts (block-FP8 "bsgemm-moe")."""

    quant_method: str = "bsgemm-moe"
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"

    def validate(self) -> None:
        _require(self.quant_method == "bsgemm-moe",
                 f"quantization_config.quant_method={self.quant_method!r}: only 'bsgemm-moe' block-FP8 experts are supported")
        _require(len(self.weight_block_size) == 2 and all(b > 0 for b in self.weight_block_size),
                 "quantization_config.weight_block_size must be two positive ints")


@dataclasses.dataclass(frozen=True)
class Drama3Config:
    text: TextConfig
    tower: TowerConfig
    quant: QuantConfig | None
    semantic_start_token_id: int
    semantic_end_token_id: int
    eos_token_id: int
    name: str = "drama-3"

    @property
    def band_size(self) -> int:
        return self.semantic_end_token_id - self.semantic_start_token_id + 1

    @property
    def num_codebooks(self) -> int:
        return self.tower.num_codebooks

    @property
    def row_width(self) -> int:
        """Ints per frame row: [main_token, c0, ..., c_{K-1}]."""
        return 1 + self.tower.num_codebooks

    def validate(self) -> "Drama3Config":
        self.text.validate()
        self.tower.validate()
        if self.quant is not None:
            self.quant.validate()
        _require(self.band_size == self.tower.vocab_size,
                 f"semantic band size {self.band_size} (semantic_end - semantic_start + 1) must equal "
                 f"audio_decoder_config.vocab_size {self.tower.vocab_size}")
        _require(0 <= self.semantic_start_token_id and self.semantic_end_token_id < self.text.vocab_size,
                 "semantic band lies outside the text vocabulary")
        _require(not (self.semantic_start_token_id <= self.eos_token_id <= self.semantic_end_token_id),
                 "eos_token_id lies inside the semantic band")
        _require(0 <= self.eos_token_id < self.text.vocab_size, "eos_token_id outside the text vocabulary")
        _require(self.tower.dim == self.text.hidden_size,
                 "audio_decoder_config.dim must equal text_config.hidden_size")
        _require((self.tower.n_head, self.tower.n_local_heads, self.tower.head_dim)
                 == (self.text.num_attention_heads, self.text.num_key_value_heads, self.text.head_dim),
                 "audio_decoder_config heads (n_head, n_local_heads, head_dim) must equal the backbone's")
        return self

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Drama3Config":
        _require(d.get("model_type") == "fish_omni",
                 f"config.json model_type={d.get('model_type')!r}: expected 'fish_omni'")
        _require(d.get("audio_encoder_config") is None, "config.json: audio_encoder_config must be null")
        _require(not d.get("extra_samplable_token_ids"), "config.json: extra_samplable_token_ids must be empty")
        for key in ("text_config", "audio_decoder_config", "semantic_start_token_id",
                    "semantic_end_token_id", "eos_token_id"):
            _require(key in d, f"config.json: missing required key {key!r}")
        known_top = {"model_type", "architectures", "fish_schema_version", "speech_template_version",
                     "semantic_start_token_id", "semantic_end_token_id", "eos_token_id", "quantization_config",
                     "audio_encoder_config", "extra_samplable_token_ids", "text_config", "audio_decoder_config",
                     "torch_dtype", "dtype", "transformers_version", "name"}
        _log_unknown("config.json", d, known_top)
        q = d.get("quantization_config")
        quant = None
        if q is not None:
            _log_unknown("quantization_config", q, {"quant_method", "weight_block_size", "activation_scheme", "fmt",
                                                      "modules_to_not_convert"})
            quant = QuantConfig(quant_method=q.get("quant_method", "bsgemm-moe"),
                                weight_block_size=tuple(q.get("weight_block_size", (128, 128))),
                                activation_scheme=q.get("activation_scheme", "dynamic"))
        return cls(text=_parse_text(d["text_config"]), tower=_parse_tower(d["audio_decoder_config"]), quant=quant,
                   semantic_start_token_id=int(d["semantic_start_token_id"]),
                   semantic_end_token_id=int(d["semantic_end_token_id"]),
                   eos_token_id=_single_int(d["eos_token_id"], "eos_token_id"),
                   name=d.get("name", "drama-3")).validate()

    @classmethod
    def from_json(cls, path: str | Path) -> "Drama3Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """The `fish_omni` config.json form (what the real checkpoint carries)."""
        t, a = self.text, self.tower
        text = {
            "model_type": "fish_omni_text", "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
            "num_hidden_layers": t.num_hidden_layers, "num_attention_heads": t.num_attention_heads,
            "num_key_value_heads": t.num_key_value_heads, "head_dim": t.head_dim,
            "layer_types": list(t.layer_types), "mlp_layer_types": ["moe"] * t.num_hidden_layers,
            "full_attention_interval": t.full_attention_layers[0] + 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta,
                                "partial_rotary_factor": t.partial_rotary_factor},
            "rms_norm_eps": t.rms_norm_eps, "hidden_act": "silu",
            "linear_num_key_heads": t.linear_num_key_heads, "linear_num_value_heads": t.linear_num_value_heads,
            "linear_key_head_dim": t.linear_key_head_dim, "linear_value_head_dim": t.linear_value_head_dim,
            "linear_conv_kernel_dim": t.linear_conv_kernel_dim, "num_experts": t.num_experts,
            "num_experts_per_tok": t.num_experts_per_tok, "moe_intermediate_size": t.moe_intermediate_size,
            "shared_expert_intermediate_size": t.shared_expert_intermediate_size,
            "max_position_embeddings": t.max_position_embeddings, "mamba_ssm_dtype": t.ssm_state_dtype,
            "rotary_interleaved": False, "use_qk_norm": True, "attn_output_gate": True,
            "layernorm_zero_centered_gamma": True, "shared_expert_gate": True, "tie_word_embeddings": False,
        }
        tower = {
            "model_type": "fish_qwen3_audio_decoder", "decoder_type": "codebook_mtp_shared", "dim": a.dim,
            "n_head": a.n_head, "n_local_heads": a.n_local_heads, "head_dim": a.head_dim, "n_layer": a.n_layer,
            "shared_enrichment_layers": a.n_layer, "num_codebooks": a.num_codebooks, "vocab_size": a.vocab_size,
            "intermediate_size": a.intermediate_size, "rope_base": a.rope_base, "rotary_percent": a.rotary_percent,
            "norm_eps": a.norm_eps, "vq_backbone_codebooks": a.vq_backbone_codebooks,
            "vq_feature_placement": a.vq_feature_placement, "vq_feature_scope": "all_vq",
            "attention_output_gate": True, "attention_qk_norm": False, "rotary_interleaved": False,
            "layernorm_zero_centered_gamma": True, "use_moe": False,
        }
        out = {
            "model_type": "fish_omni", "architectures": ["FishOmniModel"], "fish_schema_version": 1,
            "speech_template_version": "reference-bracket-v1",
            "semantic_start_token_id": self.semantic_start_token_id,
            "semantic_end_token_id": self.semantic_end_token_id, "eos_token_id": self.eos_token_id,
            "audio_encoder_config": None, "extra_samplable_token_ids": [],
            "text_config": text, "audio_decoder_config": tower, "name": self.name,
        }
        if self.quant is not None:
            out["quantization_config"] = {"quant_method": self.quant.quant_method,
                                          "weight_block_size": list(self.quant.weight_block_size),
                                          "activation_scheme": self.quant.activation_scheme}
        return out

    def replace_text(self, **kw) -> "Drama3Config":
        return dataclasses.replace(self, text=dataclasses.replace(self.text, **kw)).validate()


def _single_int(v: Any, key: str) -> int:
    if isinstance(v, list):
        _require(len(v) == 1, f"config.json: {key} must be a single id, got {v}")
        v = v[0]
    return int(v)


def _log_unknown(where: str, d: dict, known: set[str]) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        log.info("%s: ignoring unknown keys %s", where, unknown)


_TEXT_FIXED = {  # fish-only keys that must hold these values (drama3-architecture.md 3.1)
    "rotary_interleaved": False, "use_qk_norm": True, "attn_output_gate": True,
    "layernorm_zero_centered_gamma": True, "shared_expert_gate": True, "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def _parse_text(d: dict[str, Any]) -> TextConfig:
    for key, want in _TEXT_FIXED.items():
        if key in d:
            _require(d[key] == want, f"text_config.{key}={d[key]!r} is not supported (expected {want!r})")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    _require("mrope_section" not in rope and not rope.get("mrope_interleaved", False),
             "text_config.rope_parameters: multimodal RoPE (mrope_section) is not supported; Drama 3 uses 1-D positions")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    _require(rope_type == "default", f"text_config.rope_parameters.rope_type={rope_type!r} is not supported")
    rope_theta = rope.get("rope_theta", d.get("rope_theta"))
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    _require(rope_theta is not None, "text_config: missing rope_theta (flat or in rope_parameters)")
    _require(partial is not None, "text_config: missing partial_rotary_factor (flat or in rope_parameters)")
    n_layers = int(d["num_hidden_layers"])
    if "layer_types" in d:
        layer_types = tuple(d["layer_types"])
    else:
        interval = int(d.get("full_attention_interval", 4))
        layer_types = tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n_layers))
    mlp_types = d.get("mlp_layer_types")
    if mlp_types is not None:
        _require(list(mlp_types) == ["moe"] * n_layers, "text_config.mlp_layer_types: every layer must be 'moe'")
    known = set(TextConfig.__dataclass_fields__) | set(_TEXT_FIXED) | {
        "model_type", "rope_parameters", "rope_scaling", "full_attention_interval", "mlp_layer_types",
        "mamba_ssm_dtype", "router_aux_loss_coef", "initializer_range", "attention_bias", "attention_dropout",
        "use_cache", "output_router_logits", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype",
        "norm_topk_prob", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"}
    _log_unknown("text_config", d, known)
    _require(not d.get("mtp_num_hidden_layers"), "text_config.mtp_num_hidden_layers: Drama 3 has no backbone MTP head")
    _require(d.get("norm_topk_prob", True) is True, "text_config.norm_topk_prob=false is not supported")
    try:
        return TextConfig(
            vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]), num_hidden_layers=n_layers,
            num_attention_heads=int(d["num_attention_heads"]), num_key_value_heads=int(d["num_key_value_heads"]),
            head_dim=int(d["head_dim"]), layer_types=layer_types, rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            linear_num_key_heads=int(d["linear_num_key_heads"]), linear_num_value_heads=int(d["linear_num_value_heads"]),
            linear_key_head_dim=int(d["linear_key_head_dim"]), linear_value_head_dim=int(d["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(d["linear_conv_kernel_dim"]), num_experts=int(d["num_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]), moe_intermediate_size=int(d["moe_intermediate_size"]),
            shared_expert_intermediate_size=int(d["shared_expert_intermediate_size"]),
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            ssm_state_dtype=str(d.get("mamba_ssm_dtype", "float32")),
        )
    except KeyError as e:
        raise ConfigError(f"text_config: missing required key {e.args[0]!r}") from None


def _parse_tower(d: dict[str, Any]) -> TowerConfig:
    _require(d.get("decoder_type", "codebook_mtp_shared") == "codebook_mtp_shared",
             f"audio_decoder_config.decoder_type={d.get('decoder_type')!r} is not supported")
    _require(not d.get("use_moe", False), "audio_decoder_config.use_moe=true is not supported")
    # `attention_qk_norm` and `rotary_interleaved` are written misleadingly by the exporter and are ignored:
    # q/k norms always exist and the tower RoPE is always interleaved (drama3-architecture.md 3.9 item 5).
    known = set(TowerConfig.__dataclass_fields__) | {
        "model_type", "decoder_type", "shared_enrichment_layers", "vq_feature_scope", "attention_output_gate",
        "attention_qk_norm", "rotary_interleaved", "layernorm_zero_centered_gamma", "use_moe", "mtp_spec",
        "dropout", "attn_dropout", "max_seq_len", "torch_dtype", "dtype", "codebook_size"}
    _log_unknown("audio_decoder_config", d, known)
    try:
        n_layer = int(d.get("shared_enrichment_layers", d["n_layer"]))
        return TowerConfig(
            dim=int(d["dim"]), n_head=int(d["n_head"]), n_local_heads=int(d["n_local_heads"]),
            head_dim=int(d["head_dim"]), n_layer=n_layer, num_codebooks=int(d["num_codebooks"]),
            vocab_size=int(d.get("vocab_size", d.get("codebook_size", 0))),
            intermediate_size=int(d["intermediate_size"]), rope_base=float(d.get("rope_base", 1e7)),
            rotary_percent=float(d.get("rotary_percent", 0.25)), norm_eps=float(d.get("norm_eps", 1e-6)),
            vq_backbone_codebooks=int(d["vq_backbone_codebooks"]),
            vq_feature_placement=str(d["vq_feature_placement"]),
        )
    except KeyError as e:
        raise ConfigError(f"audio_decoder_config: missing required key {e.args[0]!r}") from None


# ---------------------------------------------------------------------------------------------- presets
def _layer_types(n: int, interval: int = 4) -> tuple[str, ...]:
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n))


def full_config() -> Drama3Config:
    """The 35B-A3B shapes (drama3-architecture.md 2.1, 3.1).

    Placeholders, documented because the real config.json is not public: tower `intermediate_size` (6144, estimated
    from the checkpoint size), `vq_backbone_codebooks` (0 / `mtp_shared_pre`), text `vocab_size` and the token ids
    (Qwen3.5's 248,320 vocabulary extended by a 4096-token semantic band), `max_position_embeddings` (32768).
    A real checkpoint always overrides them through its own config.json.
    """
    text = TextConfig(
        vocab_size=252_416, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
        head_dim=256, layer_types=_layer_types(40), rope_theta=1e7, partial_rotary_factor=0.25, rms_norm_eps=1e-6,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, max_position_embeddings=32768)
    tower = TowerConfig(dim=2048, n_head=16, n_local_heads=2, head_dim=256, n_layer=4, num_codebooks=10,
                        vocab_size=4096, intermediate_size=6144, rope_base=1e7, rotary_percent=0.25, norm_eps=1e-6,
                        vq_backbone_codebooks=0, vq_feature_placement="mtp_shared_pre")
    return Drama3Config(text=text, tower=tower, quant=QuantConfig(), semantic_start_token_id=248_320,
                        semantic_end_token_id=248_320 + 4095, eos_token_id=248_046).validate()


# Tiny vocabulary layout: byte-level BPE text tokens first, then specials, then the semantic band.
TINY_TEXT_TOKENS = 384
TINY_BAND = 64


def tiny_config() -> Drama3Config:
    """Same structure as `full` (4 layers: 3 GDN + 1 gated attention, MoE everywhere, 13-layer tower) at toy sizes."""
    n_special = 32  # <|im_start|>, <|im_end|>, <|voice|>, <|text|>, <|interleave|>, 16 speakers, spare
    text = TextConfig(
        vocab_size=TINY_TEXT_TOKENS + n_special + TINY_BAND, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=_layer_types(4), rope_theta=1e7,
        partial_rotary_factor=0.25, rms_norm_eps=1e-6, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=4096)
    tower = TowerConfig(dim=64, n_head=4, n_local_heads=2, head_dim=16, n_layer=4, num_codebooks=10,
                        vocab_size=TINY_BAND, intermediate_size=96, rope_base=1e7, rotary_percent=0.25, norm_eps=1e-6,
                        vq_backbone_codebooks=3, vq_feature_placement="backbone_partial")
    start = TINY_TEXT_TOKENS + n_special
    return Drama3Config(text=text, tower=tower, quant=QuantConfig(), semantic_start_token_id=start,
                        semantic_end_token_id=start + TINY_BAND - 1, eos_token_id=TINY_TEXT_TOKENS + 1,
                        name="drama-3-tiny-random").validate()


PRESETS = {"full": full_config, "tiny": tiny_config}


def preset(name: str) -> Drama3Config:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
