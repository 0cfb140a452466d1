"""Turn request references into (codes [K, T], transcript) pairs: base64 / data-URI / allowed file:// audio is
decoded and encoded by the codec; pre-encoded codes are validated. No outbound network fetches, ever."""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path

import numpy as np

from drama3_jax.codec.audio_io import read_audio
from serving.protocol import APIError

MIN_REF_SECONDS, MAX_REF_SECONDS = 0.5, 30.0
MAX_AUDIO_BYTES = 16 << 20
_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(;[\w=.+-]+)*;base64,(?P<data>.*)$", re.S)


class ReferenceResolver:
    def __init__(self, codec, model_cfg, allowed_local_media_path: str | None = None, encode_bucket_frames=None):
        self.codec = codec
        self.encode_bucket_frames = encode_bucket_frames
        self.cfg = model_cfg
        self.allowed = Path(allowed_local_media_path).resolve() if allowed_local_media_path else None

    # ------------------------------------------------------------------------------------------ audio
    def audio_bytes(self, locator: str, param: str) -> bytes:
        locator = locator.strip()
        if locator.startswith(("http://", "https://")):
            raise APIError(400, "remote audio URLs are not fetched by this server; send base64 or a data: URI",
                           param=param)
        if locator.startswith("file://"):
            if self.allowed is None:
                raise APIError(400, "file:// audio needs the server option --allowed-local-media-path", param=param)
            path = Path(locator[len("file://"):]).resolve()
            if self.allowed not in path.parents and path != self.allowed:
                raise APIError(400, "file:// path is outside the allowed media directory", param=param)
            if not path.is_file():
                raise APIError(400, "file:// path does not exist", param=param)
            if path.stat().st_size > MAX_AUDIO_BYTES:
                raise APIError(400, f"audio larger than {MAX_AUDIO_BYTES >> 20} MiB", param=param)
            return path.read_bytes()
        m = _DATA_URI.match(locator)
        payload = m.group("data") if m else locator
        if len(payload) > MAX_AUDIO_BYTES * 4 // 3 + 4:
            raise APIError(400, f"audio larger than {MAX_AUDIO_BYTES >> 20} MiB", param=param)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, "audio is not valid base64 (or a data: URI)", param=param) from None

    def encode_audio(self, locator: str, param: str) -> np.ndarray:
        """Audio locator -> codes [K, T]; duration must be within [0.5, 30] s."""
        raw = self.audio_bytes(locator, param)
        try:
            audio, sr = read_audio(io.BytesIO(raw))
        except ValueError:
            raise APIError(400, "audio could not be decoded (send wav, flac, ogg or mp3)", param=param) from None
        seconds = audio.shape[0] / sr if sr else 0.0
        if not (MIN_REF_SECONDS <= seconds <= MAX_REF_SECONDS):
            raise APIError(400, f"reference audio lasts {seconds:.2f} s; it must last {MIN_REF_SECONDS}-"
                                f"{MAX_REF_SECONDS:.0f} s", param=param)
        return self.codec.encode(audio, sr, bucket_frames=self.encode_bucket_frames)

    # ------------------------------------------------------------------------------------------ codes
    def check_codes(self, codes, param: str) -> np.ndarray:
        K = self.cfg.num_codebooks
        try:
            arr = np.asarray(codes)
        except (ValueError, TypeError):
            arr = None
        if arr is None or arr.dtype == object or arr.ndim != 2 or arr.shape[0] != K or arr.shape[1] == 0:
            raise APIError(400, f"codes must be an integer array [{K}][T] with T >= 1", param=param)
        if not np.issubdtype(arr.dtype, np.integer):
            raise APIError(400, "codes must be integers", param=param)
        limits = [self.cfg.band_size] + list(self.codec.cfg.codebook_sizes[1:])
        for k in range(K):
            if arr[k].min() < 0 or arr[k].max() >= limits[k]:
                raise APIError(400, f"codes of codebook {k} must be in [0, {limits[k]})", param=param)
        seconds = arr.shape[1] * self.codec.frame_length / self.codec.cfg.sample_rate
        if seconds > MAX_REF_SECONDS + 1:
            raise APIError(400, f"reference codes last {seconds:.1f} s; at most {MAX_REF_SECONDS:.0f} s",
                           param=param)
        return arr.astype(np.int32)
