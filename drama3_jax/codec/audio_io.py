"""Audio I/O for the codec (host side, numpy + soundfile): read any format libsndfile knows (wav, flac, ogg, mp3...),
mix down and resample to the codec rate, write wav / flac / raw pcm16. soundfile is imported only where a file format
is read or written, so the codec runs where it is missing.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np

WRITE_FORMATS = ("wav", "flac", "pcm")


def read_audio(path: str | Path | io.IOBase) -> tuple[np.ndarray, int]:
    """-> (samples [N, C] float32 in [-1, 1], sample rate)."""
    import soundfile as sf

    try:
        audio, sr = sf.read(path, dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError) as e:
        raise ValueError(f"cannot read audio {path}: {e}") from None
    return audio, int(sr)


def resample(audio: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Polyphase resampling along axis 0 (scipy.signal.resample_poly, Kaiser-windowed FIR), float32."""
    if rate_in == rate_out:
        return np.asarray(audio, np.float32)
    from scipy.signal import resample_poly

    g = math.gcd(rate_in, rate_out)
    return resample_poly(np.asarray(audio, np.float64), rate_out // g, rate_in // g, axis=0).astype(np.float32)


def to_mono(audio: np.ndarray, sample_rate: int, target_rate: int) -> np.ndarray:
    """[N] or [N, C] samples at sample_rate -> mono float32 [N'] at target_rate (channel mean, then resampling).
    Raises ValueError on empty or non-finite audio, or a non-positive rate."""
    audio = np.asarray(audio, np.float32)
    if audio.ndim not in (1, 2):
        raise ValueError(f"audio must be [samples] or [samples, channels], got shape {audio.shape}")
    if sample_rate <= 0:
        raise ValueError(f"sample rate must be positive, got {sample_rate}")
    if audio.size == 0:
        raise ValueError("audio is empty")
    if not np.all(np.isfinite(audio)):
        raise ValueError("audio contains NaN or infinite samples")
    mono = audio if audio.ndim == 1 else audio.mean(axis=1)
    return resample(mono, int(sample_rate), int(target_rate))


def load_audio(path: str | Path | io.IOBase, target_rate: int) -> np.ndarray:
    """Read a file and return mono float32 samples at target_rate."""
    audio, sr = read_audio(path)
    return to_mono(audio, sr, target_rate)


def pcm16(audio: np.ndarray) -> np.ndarray:
    """float samples (clipped to [-1, 1]) -> int16."""
    return np.round(np.clip(np.asarray(audio, np.float32), -1.0, 1.0) * 32767.0).astype(np.int16)


def audio_bytes(audio: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Mono float samples [N] -> file bytes: 'wav' / 'flac' (16-bit PCM) or 'pcm' (raw s16le, no header)."""
    if fmt not in WRITE_FORMATS:
        raise ValueError(f"unsupported audio format {fmt!r}; choose one of {WRITE_FORMATS}")
    samples = pcm16(audio)
    if fmt == "pcm":
        return samples.astype("<i2").tobytes()
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, sample_rate, format=fmt.upper(), subtype="PCM_16")
    return buf.getvalue()


def write_audio(path: str | Path, audio: np.ndarray, sample_rate: int, fmt: str | None = None) -> Path:
    """Write mono samples; fmt from the suffix when None (.wav, .flac, .pcm / .raw)."""
    path = Path(path)
    if fmt is None:
        suffix = path.suffix.lower().lstrip(".")
        fmt = "pcm" if suffix == "raw" else suffix
    path.write_bytes(audio_bytes(audio, sample_rate, fmt))
    return path
