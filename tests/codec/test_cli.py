"""`python -m drama3_jax.codec encode|decode` on a converted tiny checkpoint."""

from __future__ import annotations

import numpy as np
import soundfile as sf

from drama3_jax.codec.__main__ import main
from drama3_jax.codec.audio_io import pcm16
from tests.codec.conftest import random_codes, random_speech


def test_encode_then_decode(tmp_path, tiny_codec_dir, tiny_codec, capsys):
    wav = tmp_path / "in.wav"
    sf.write(wav, random_speech(8000, seed=60, channels=2), 22050)  # 0.36 s stereo at 22.05 kHz
    assert main(["encode", str(wav), "--checkpoint", str(tiny_codec_dir), "--out", str(tmp_path / "c.npy")]) == 0
    codes = np.load(tmp_path / "c.npy")
    assert codes.shape == (10, 8) and codes.dtype == np.int32
    audio, sr = sf.read(wav, dtype="float32")
    np.testing.assert_array_equal(codes, tiny_codec.encode(audio, sr))
    assert main(["decode", str(tmp_path / "c.npy"), "--checkpoint", str(tiny_codec_dir),
                 "--out", str(tmp_path / "out.flac")]) == 0
    audio, sr = sf.read(tmp_path / "out.flac", dtype="int16")
    assert sr == 44100 and audio.shape == (8 * 2048,)
    np.testing.assert_array_equal(audio, pcm16(tiny_codec.decode(codes)))
    assert "codes (10, 8)" in capsys.readouterr().out


def test_errors_are_reported_not_raised(tmp_path, tiny_codec_dir, tiny_codec_cfg, capsys):
    np.save(tmp_path / "bad.npy", random_codes(tiny_codec_cfg, 1, 4, seed=61)[0, :9])
    assert main(["decode", str(tmp_path / "bad.npy"), "--checkpoint", str(tiny_codec_dir),
                 "--out", str(tmp_path / "o.wav")]) == 1
    assert "9 codebooks" in capsys.readouterr().err
    assert main(["encode", str(tmp_path / "missing.wav"), "--checkpoint", str(tiny_codec_dir),
                 "--out", str(tmp_path / "c.npy")]) == 1
    assert "cannot read audio" in capsys.readouterr().err
    assert main(["decode", str(tmp_path / "bad.npy"), "--checkpoint", str(tmp_path), "--out", "o.wav"]) == 1
    assert "codec_config.json" in capsys.readouterr().err
