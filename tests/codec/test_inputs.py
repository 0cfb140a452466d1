"""Bad and unusual inputs give clear errors or correct results; audio I/O round trips."""

from __future__ import annotations

import math

import numpy as np
import pytest
import soundfile as sf

from drama3_jax.codec.audio_io import audio_bytes, load_audio, pcm16, read_audio, resample, to_mono, write_audio
from tests.codec.conftest import assert_codes_match, random_codes, random_speech
from tests.reference.fish_codec import fish_encode


@pytest.mark.parametrize("mutate,message", [
    (lambda c: c.__setitem__((0, 5), 64), "codebook 0 has code 64 outside"),  # tiny semantic codebook: 64
    (lambda c: c.__setitem__((4, 0), 48), "codebook 4 has code 48 outside"),  # tiny residual codebooks: 48
    (lambda c: c.__setitem__((9, 2), -1), "codebook 9 has code -1 outside"),
])
def test_out_of_range_codes(tiny_codec, tiny_codec_cfg, mutate, message):
    codes = random_codes(tiny_codec_cfg, 1, 6, seed=50)[0]
    mutate(codes)
    with pytest.raises(ValueError, match=message):
        tiny_codec.decode(codes)
    with pytest.raises(ValueError, match=message):
        tiny_codec.step(tiny_codec.init_state(1), codes[None])


def test_malformed_codes(tiny_codec, tiny_codec_cfg):
    codes = random_codes(tiny_codec_cfg, 1, 6, seed=51)[0]
    with pytest.raises(ValueError, match="9 codebooks, the codec has 10"):
        tiny_codec.decode(codes[:9])
    with pytest.raises(ValueError, match="no frames"):
        tiny_codec.decode(codes[:, :0])
    with pytest.raises(ValueError, match="must be integers"):
        tiny_codec.decode(codes.astype(np.float32))
    with pytest.raises(ValueError, match="codes must be"):
        tiny_codec.decode(codes[0])
    state = tiny_codec.init_state(2)
    with pytest.raises(ValueError, match="do not match 2 streams"):
        tiny_codec.step(state, codes[None])
    with pytest.raises(ValueError, match="n_new"):
        tiny_codec.step(state, np.stack([codes, codes]), [3, 7])


@pytest.mark.parametrize("audio,message", [
    (np.zeros(0, np.float32), "empty"),
    (np.zeros((0, 2), np.float32), "empty"),
    (np.full(3000, np.nan, np.float32), "NaN or infinite"),
    (np.zeros((4, 4, 4), np.float32), "must be"),
])
def test_bad_audio(tiny_codec, audio, message):
    with pytest.raises(ValueError, match=message):
        tiny_codec.encode(audio, 44100)


def test_bad_sample_rate(tiny_codec):
    with pytest.raises(ValueError, match="sample rate"):
        tiny_codec.encode(random_speech(1000, seed=52), 0)


@pytest.mark.parametrize("name,audio,rate", [
    ("silence", np.zeros(int(0.3 * 44100), np.float32), 44100),
    ("0.1 s clip", random_speech(4410, seed=53), 44100),
    ("8 kHz stereo", random_speech(2800, seed=54, channels=2), 8000),
])
def test_unusual_audio_encodes_like_fish(tiny_codec, tiny_fish, name, audio, rate):
    """Encoding resamples to 44.1 kHz mono, pads to whole frames and matches Fish on that signal."""
    codes = tiny_codec.encode(audio, rate)
    mono = to_mono(audio, rate, 44100)
    assert codes.shape == (10, math.ceil(mono.shape[0] / 2048)) and codes.dtype == np.int32
    assert_codes_match(tiny_codec, mono, codes, fish_encode(tiny_fish, mono[None])[0])


def test_to_mono_resamples_and_mixes():
    t = np.arange(8000) / 8000
    stereo = np.stack([np.sin(2 * np.pi * 440 * t), 0.5 * np.sin(2 * np.pi * 440 * t)], axis=1)
    mono = to_mono(stereo, 8000, 44100)
    assert mono.dtype == np.float32 and mono.shape == (44100,)
    t44 = np.arange(44100) / 44100
    np.testing.assert_allclose(mono[2000:-2000], 0.75 * np.sin(2 * np.pi * 440 * t44[2000:-2000]), atol=2e-3)
    np.testing.assert_array_equal(resample(mono, 44100, 44100), mono)


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_audio_file_roundtrip(tmp_path, fmt):
    audio = random_speech(5000, seed=55)
    path = write_audio(tmp_path / f"x.{fmt}", audio, 44100)
    back, sr = read_audio(path)
    assert sr == 44100 and back.shape == (5000, 1) and back.dtype == np.float32
    np.testing.assert_array_equal(sf.read(path, dtype="int16")[0], pcm16(audio))
    np.testing.assert_allclose(load_audio(path, 44100), audio, atol=1 / 16384)


def test_pcm16_bytes_and_clipping(tmp_path):
    audio = np.array([0.0, 0.5, -0.5, 1.5, -2.0], np.float32)
    raw = audio_bytes(audio, 44100, "pcm")
    np.testing.assert_array_equal(np.frombuffer(raw, "<i2"), [0, 16384, -16384, 32767, -32767])
    write_audio(tmp_path / "x.raw", audio, 44100)
    assert (tmp_path / "x.raw").read_bytes() == raw
    with pytest.raises(ValueError, match="unsupported audio format"):
        audio_bytes(audio, 44100, "mp3")


def test_unreadable_audio(tmp_path):
    (tmp_path / "bad.wav").write_bytes(b"RIFF....garbage")
    with pytest.raises(ValueError, match="cannot read audio"):
        read_audio(tmp_path / "bad.wav")


def test_stereo_file_is_mixed_down(tmp_path):
    audio = random_speech(3000, seed=56, channels=2)
    sf.write(tmp_path / "s.wav", audio, 16000, subtype="FLOAT")
    mono = load_audio(tmp_path / "s.wav", 44100)
    np.testing.assert_allclose(mono, resample(audio.mean(axis=1), 16000, 44100), atol=1e-6)
