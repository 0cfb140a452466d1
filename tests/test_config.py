"""Config parsing, validation and presets."""

from __future__ import annotations

import copy
import json

import pytest

from drama3_jax.checkpoint import count_params
from drama3_jax.config import ConfigError, Drama3Config, full_config, preset, tiny_config


def test_full_preset_parameter_counts():
    c = count_params(full_config())
    print(f"full preset: backbone {c['backbone'] / 1e9:.2f}B total / {c['backbone_active'] / 1e9:.2f}B active; "
          f"tower {c['tower'] / 1e9:.2f}B; whole talker {c['total'] / 1e9:.2f}B / {c['active'] / 1e9:.2f}B active")
    assert 34e9 < c["backbone"] < 36e9  # Qwen3.5-35B-A3B backbone (+ the codebook table)
    assert 3.0e9 < c["backbone_active"] < 3.9e9  # "A3B": ~3B active per token (embeddings included)
    assert c["routed_experts"] == 40 * 256 * 3 * 2048 * 512
    assert 0.5e9 < c["tower"] < 2e9 and c["total"] == c["backbone"] + c["tower"]


def test_round_trip_through_config_json(tmp_path):
    for cfg in (full_config(), tiny_config()):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(cfg.to_dict()))
        assert Drama3Config.from_json(tmp_path) == cfg


def test_flat_rope_keys_are_accepted():
    d = tiny_config().to_dict()
    rope = d["text_config"].pop("rope_parameters")
    d["text_config"]["rope_theta"] = rope["rope_theta"]
    d["text_config"]["partial_rotary_factor"] = rope["partial_rotary_factor"]
    assert Drama3Config.from_dict(d) == tiny_config()


def test_layer_types_derived_from_interval():
    d = tiny_config().to_dict()
    del d["text_config"]["layer_types"]
    assert Drama3Config.from_dict(d).text.layer_types == tiny_config().text.layer_types


def test_unknown_keys_are_logged_not_fatal(caplog):
    d = tiny_config().to_dict()
    d["text_config"]["some_future_key"] = 1
    with caplog.at_level("INFO"):
        Drama3Config.from_dict(d)
    assert "some_future_key" in caplog.text


def _bad(mutate):
    d = copy.deepcopy(tiny_config().to_dict())
    mutate(d)
    return d


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["text_config"]["rope_parameters"].update(mrope_section=[11, 11, 10]), "mrope"),
    (lambda d: d["text_config"].update(tie_word_embeddings=True), "tie_word_embeddings"),
    (lambda d: d["text_config"].update(layer_types=["linear_attention", "full_attention", "linear_attention",
                                                    "full_attention"][::-1]), "periodic"),
    (lambda d: d["text_config"].update(layer_types=["linear_attention"] * 4), "no full_attention"),
    (lambda d: d["text_config"].update(mlp_layer_types=["dense"] * 4), "mlp_layer_types"),
    (lambda d: d.update(model_type="qwen3_5_moe"), "fish_omni"),
    (lambda d: d.update(semantic_end_token_id=d["semantic_end_token_id"] - 1), "band size"),
    (lambda d: d.update(eos_token_id=d["semantic_start_token_id"] + 3), "eos_token_id"),
    (lambda d: d["text_config"].pop("hidden_size"), "hidden_size"),
    (lambda d: d["audio_decoder_config"].update(vq_feature_placement="elsewhere"), "vq_feature_placement"),
    (lambda d: d["audio_decoder_config"].update(n_head=8), "heads"),
    (lambda d: d["quantization_config"].update(quant_method="gptq"), "bsgemm-moe"),
    (lambda d: d["text_config"].update(mamba_ssm_dtype="float16"), "mamba_ssm_dtype"),
    (lambda d: d.update(audio_encoder_config={}), "audio_encoder_config"),
])
def test_bad_config_values_raise_clear_errors(mutate, message):
    with pytest.raises(ConfigError, match=message):
        Drama3Config.from_dict(_bad(mutate))


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("huge")
