"""Parity with Fish's PyTorch ModifiedDAC (fish-speech 0.1.0) on the same random weights, loaded through our converter.

Decode: relative L2 error < 1e-4 (fp32). Encode: codes identical up to documented near-ties (conftest
`assert_codes_match`). The full-size runs use clips longer than 6 s, so the decoder's 128-frame and the encoder's
512-step attention windows are exceeded (the tiny preset's windows are 8 and 32).
"""

from __future__ import annotations

import numpy as np
import pytest

from drama3_jax.codec import Codec, convert_codec, full_codec_config, load_codec, write_random_codec_pth
from tests.codec.conftest import assert_codes_match, random_codes, random_speech, rel_err
from tests.reference.fish_codec import build_fish_codec, fish_decode, fish_encode


def test_tiny_decode_matches_fish(tiny_codec, tiny_fish, tiny_codec_cfg):
    codes = random_codes(tiny_codec_cfg, 2, 40, seed=11)
    ours, ref = tiny_codec.decode(codes), fish_decode(tiny_fish, codes)
    assert ours.shape == ref.shape == (2, 40 * 2048)
    assert ref.std() > 0.05 and np.abs(ref).max() < 0.999  # not silent, not saturated by tanh
    assert rel_err(ours, ref) < 1e-4


def test_tiny_encode_matches_fish(tiny_codec, tiny_fish):
    audio = random_speech(75_001, seed=12)  # 36.6 frames: Fish pads the last one with zeros
    ours = tiny_codec.encode(audio, 44100)
    ref = fish_encode(tiny_fish, audio[None])[0]
    assert ours.shape == (10, 37)
    assert_codes_match(tiny_codec, audio, ours, ref)


@pytest.fixture(scope="module")
def full_pair(tmp_path_factory):
    """(our Codec, Fish's DAC) on one random full-size codec.pth (1.9 GB with Fish's buffers)."""
    cfg = full_codec_config()
    d = tmp_path_factory.mktemp("full_codec")
    pth = write_random_codec_pth(d / "codec.pth", cfg, seed=5)
    assert convert_codec(pth, d / "converted") == cfg  # the preset is inferred from the tensor shapes
    pair = Codec(load_codec(d / "converted")), build_fish_codec(cfg, pth)
    pth.unlink()
    return pair


@pytest.mark.slow
def test_full_decode_matches_fish(full_pair):
    codec, fish = full_pair
    codes = random_codes(codec.cfg, 1, 144, seed=13)  # 6.7 s > the 128-frame window
    ours, ref = codec.decode(codes), fish_decode(fish, codes)
    assert ref.std() > 0.05 and np.abs(ref).max() < 0.999
    assert rel_err(ours, ref) < 1e-4


@pytest.mark.slow
def test_full_encode_matches_fish(full_pair):
    codec, fish = full_pair
    audio = random_speech(int(6.2 * 44100), seed=14)  # 534 encoder steps > the 512-step window
    ours = codec.encode(audio, 44100)
    ref = fish_encode(fish, audio[None])[0]
    assert ours.shape == (10, 134)
    assert_codes_match(codec, audio, ours, ref)


def test_near_tie_rule_rejects_real_differences(tiny_codec):
    """The code comparison only forgives near-ties: a code changed to another row fails it."""
    audio = random_speech(4410, seed=15)
    ours = tiny_codec.encode(audio, 44100)
    other = ours.copy()
    other[3, 1] = (other[3, 1] + 1) % 48
    with pytest.raises(AssertionError, match="frame 1 codebook 3"):
        assert_codes_match(tiny_codec, audio, ours, other)
