"""Codec fixtures: a tiny random codec.pth in Fish's key layout, converted once, our codec and Fish's on it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from drama3_jax.codec import Codec, convert_codec, load_codec, tiny_codec_config, write_random_codec_pth


def random_codes(cfg, batch: int, frames: int, seed: int) -> np.ndarray:
    """[B, K, T] int32, each codebook uniform over its range."""
    r = np.random.default_rng(seed)
    return np.stack([r.integers(0, n, (batch, frames)) for n in cfg.codebook_sizes], axis=1).astype(np.int32)


def random_speech(samples: int, seed: int, channels: int = 0) -> np.ndarray:
    """Speech-like test signal: a few random harmonics with a syllable-rate envelope plus noise, peak ~0.5.
    [samples] or [samples, channels] float32."""
    r = np.random.default_rng(seed)
    t = np.arange(samples) / 44100.0
    f0 = r.uniform(90, 250)
    x = sum(r.uniform(0.2, 1.0) / h * np.sin(2 * np.pi * f0 * h * t + r.uniform(0, 6.3)) for h in range(1, 8))
    x = x * (0.6 + 0.4 * np.sin(2 * np.pi * r.uniform(2, 6) * t)) + 0.05 * r.normal(size=samples)
    x = 0.5 * x / np.abs(x).max()
    if channels:
        x = np.stack([x * r.uniform(0.5, 1.0) for _ in range(channels)], axis=1)
    return x.astype(np.float32)


# A code may differ from Fish's only at a near-tie: fp32 rounding of the latent can flip the argmax between two
# codebook rows whose scores (-squared distance of unit vectors, in [-4, 0]) are within NEAR_TIE; every later
# codebook of that frame then quantizes a different residual, so only a frame's first differing codebook is checked.
NEAR_TIE = 1e-4
MAX_TIED_FRAMES = 0.02


def rel_err(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


_encode_frames = jax.jit(lambda g, p, a: nnx.merge(g, p).encode_frames(a), static_argnums=0)


def assert_codes_match(codec: Codec, audio: np.ndarray, ours: np.ndarray, ref: np.ndarray):
    """ours/ref [K, T] encoded from the same mono audio at the codec rate; see NEAR_TIE."""
    assert ours.shape == ref.shape
    frames = np.flatnonzero((ours != ref).any(axis=0))
    assert len(frames) <= max(1, MAX_TIED_FRAMES * ours.shape[1]), f"codes differ in frames {frames}"
    if not len(frames):
        return
    fl = codec.frame_length
    padded = np.zeros((1, codec._bucket(math.ceil(audio.shape[0] / fl)) * fl), np.float32)
    padded[0, :audio.shape[0]] = audio
    model = codec.model
    z = _encode_frames(codec.graphdef, codec.params, jnp.asarray(padded))  # causal: the padding changes no frame
    for t in frames:
        residual = z[:, t:t + 1]
        for k, vq in enumerate(model.quantizer.vqs):
            scores, z_e = vq.scores(residual)
            if ours[k, t] != ref[k, t]:
                gap = float(scores[0, 0, ours[k, t]] - scores[0, 0, ref[k, t]])
                assert 0 <= gap < NEAR_TIE, f"frame {t} codebook {k}: Fish's code scores {gap} below ours"
                break
            residual = residual - vq.out_proj(z_e + (vq.codebook(jnp.asarray([[ref[k, t]]])) - z_e))


@pytest.fixture(scope="session")
def tiny_codec_cfg():
    return tiny_codec_config()


@pytest.fixture(scope="session")
def tiny_codec_pth(tmp_path_factory, tiny_codec_cfg):
    return write_random_codec_pth(tmp_path_factory.mktemp("tiny_codec") / "codec.pth", tiny_codec_cfg, seed=7)


@pytest.fixture(scope="session")
def tiny_codec_dir(tmp_path_factory, tiny_codec_pth):
    out = tmp_path_factory.mktemp("tiny_codec_converted")
    convert_codec(tiny_codec_pth, out)
    return out


@pytest.fixture(scope="session")
def tiny_codec(tiny_codec_dir) -> Codec:
    return Codec(load_codec(tiny_codec_dir))


@pytest.fixture(scope="session")
def tiny_fish(tiny_codec_cfg, tiny_codec_pth):
    from tests.reference.fish_codec import build_fish_codec

    return build_fish_codec(tiny_codec_cfg, tiny_codec_pth)
