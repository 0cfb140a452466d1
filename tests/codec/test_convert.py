"""codec.pth reading, weight-norm folding, layout checks and the converted checkpoint."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from torch.nn.utils import parametrizations, weight_norm

from drama3_jax.codec import CodecConfig, convert_codec, full_codec_config, random_codec, tiny_codec_config
from drama3_jax.codec.convert import (CodecCheckpointError, codec_tensors, expected_shapes, fold_weight_norm,
                                      load_codec, read_codec_config)
from drama3_jax.codec.torch_pickle import TorchFileError, load_state_dict
from drama3_jax.config import ConfigError


def test_torch_reader_roundtrip(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {"f32": torch.randn(3, 4, 5, generator=g), "bf16": torch.randn(6, generator=g).to(torch.bfloat16),
          "mask": torch.rand(4, 4, generator=g) > 0.5, "i64": torch.randint(-9, 9, (7,), generator=g),
          "strided": torch.randn(5, 6, generator=g).t(), "view": torch.randn(10, generator=g)[3:8],
          "scalar": torch.tensor(2.5)}
    torch.save(sd, tmp_path / "x.pth")
    got = load_state_dict(tmp_path / "x.pth")
    assert list(got) == list(sd)
    for k, t in sd.items():
        want = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
        assert got[k].shape == tuple(t.shape) and got[k].dtype == want.dtype
        np.testing.assert_array_equal(got[k].numpy(), want)


def test_torch_reader_refuses_code_and_non_zip(tmp_path):
    torch.save({"w": torch.ones(2), "fn": torch.nn.Linear(1, 1)}, tmp_path / "module.pth")
    with pytest.raises(TorchFileError, match="unsupported pickled object"):
        load_state_dict(tmp_path / "module.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a zip")
    with pytest.raises(TorchFileError, match="not a zip"):
        load_state_dict(tmp_path / "junk.pth")


@pytest.mark.parametrize("kind", ["conv", "transposed", "legacy"])
def test_weight_norm_fold_matches_torch(kind):
    """torch weight_norm(dim=0): per output channel for Conv1d, per INPUT channel for ConvTranspose1d ([in, out, k])."""
    torch.manual_seed(1)
    if kind == "conv":
        m = parametrizations.weight_norm(torch.nn.Conv1d(6, 5, 7))
    elif kind == "transposed":
        m = parametrizations.weight_norm(torch.nn.ConvTranspose1d(6, 3, 8, stride=4))
    else:
        m = weight_norm(torch.nn.Conv1d(6, 5, 1))
    with torch.no_grad():  # make g differ from ||v|| so the fold is really tested
        for n, p in m.named_parameters():
            if n.endswith(("original0", "weight_g")):
                p.mul_(torch.rand_like(p) + 0.5)
    sd = m.state_dict()
    g, v = ((sd["parametrizations.weight.original0"], sd["parametrizations.weight.original1"])
            if kind != "legacy" else (sd["weight_g"], sd["weight_v"]))
    assert g.shape[0] == (6 if kind == "transposed" else 5)
    want = torch._weight_norm(v, g, 0)  # what torch's weight-norm hooks compute
    if kind != "legacy":
        torch.testing.assert_close(m.weight, want)
    np.testing.assert_allclose(fold_weight_norm(g.numpy(), v.numpy()), want.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_converted_equals_in_memory_random_codec(tiny_codec_dir, tiny_codec_cfg):
    """codec.pth -> convert -> load gives exactly the weights random_codec builds from the same table and seed."""
    assert read_codec_config(tiny_codec_dir) == tiny_codec_cfg
    loaded = nnx.state(load_codec(tiny_codec_dir), nnx.Param)
    direct = nnx.state(random_codec(tiny_codec_cfg, seed=7), nnx.Param)
    diffs = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), loaded, direct)
    assert max(jax.tree.leaves(diffs)) < 1e-6


def test_full_layout_matches_fish_key_count():
    """fish-speech's full codec state dict has 541 keys, 6 of them buffers, and 391,430,530 weights
    (cpu-references.md 3.1; counted from fish-speech 0.1.0's modded_dac_vq.yaml model)."""
    shapes = expected_shapes(full_codec_config())
    assert len(shapes) == 535
    assert sum(int(np.prod(s)) for s in shapes.values()) == 391_430_530


@pytest.fixture(scope="module")
def tiny_state(tiny_codec_pth):
    return torch.load(tiny_codec_pth, weights_only=True)


def _convert_modified(tmp_path, state, cfg=None):
    torch.save(state, tmp_path / "codec.pth")
    return convert_codec(tmp_path / "codec.pth", tmp_path / "out", cfg)


def test_buffers_are_optional(tmp_path, tiny_state, tiny_codec_cfg):
    state = {k: v for k, v in tiny_state.items() if not k.endswith(("freqs_cis", "causal_mask"))}
    assert len(state) == len(tiny_state) - 6
    assert _convert_modified(tmp_path, state) == tiny_codec_cfg


@pytest.mark.parametrize("change,message", [
    ("extra", "unexpected tensor 'decoder.model.9.alpha'"),
    ("stray_buffer", "unexpected tensor 'decoder.model.0.freqs_cis'"),
    ("missing", "missing tensor 'quantizer.quantizer.quantizers.3.codebook.weight'"),
    ("shape", "tensor 'decoder.model.2.block.1.conv.bias' has shape (5,)"),
])
def test_layout_errors_name_the_key(tmp_path, tiny_state, tiny_codec_cfg, change, message):
    state = dict(tiny_state)
    if change == "extra":
        state["decoder.model.9.alpha"] = torch.ones(1, 4, 1)
    elif change == "stray_buffer":
        state["decoder.model.0.freqs_cis"] = torch.ones(4, 2)
    elif change == "missing":
        del state["quantizer.quantizer.quantizers.3.codebook.weight"]
    else:
        state["decoder.model.2.block.1.conv.bias"] = torch.ones(5)
    with pytest.raises(CodecCheckpointError, match="matches no codec preset") as e:
        _convert_modified(tmp_path, state)
    assert message in str(e.value)
    with pytest.raises(CodecCheckpointError, match="against the given config") as e:
        _convert_modified(tmp_path, state, tiny_codec_cfg)
    assert message in str(e.value)


def test_non_finite_weight_is_refused(tmp_path, tiny_state):
    state = dict(tiny_state)
    state["quantizer.post_module.norm.weight"] = state["quantizer.post_module.norm.weight"].clone()
    state["quantizer.post_module.norm.weight"][3] = float("nan")
    with pytest.raises(CodecCheckpointError, match="quantizer.post_module.norm.weight"):
        _convert_modified(tmp_path, state)


def test_codec_config_roundtrip_and_errors():
    for cfg in (full_codec_config(), tiny_codec_config()):
        assert CodecConfig.from_dict(cfg.to_dict()) == cfg
        assert cfg.frame_length == 2048 and cfg.n_codebooks == 10
    assert tiny_codec_config().semantic_codebook_size == 64
    d = tiny_codec_config().to_dict()
    with pytest.raises(ConfigError, match="unknown key"):
        CodecConfig.from_dict({**d, "bogus": 1})
    with pytest.raises(ConfigError, match="frame_length"):
        CodecConfig.from_dict({**d, "decoder_rates": [8, 8, 4, 4]})


def test_table_paths_cover_the_module_tree_once(tiny_codec_cfg):
    """Every NNX parameter of the model has exactly one row in the conversion table."""
    paths = [s.path for s in codec_tensors(tiny_codec_cfg)]
    assert len(paths) == len(set(paths))
    model = random_codec(tiny_codec_cfg)
    params = {".".join(str(p) for p in k) for k, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert params == set(paths)
