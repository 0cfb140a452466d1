"""Uploaded voices: a reference encoded once (codes + transcript), stored on disk under a configured directory."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import numpy as np

from serving.protocol import APIError

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


class VoiceStore:
    def __init__(self, directory: str | Path, max_voices: int = 1000):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_voices = max_voices
        self.lock = threading.Lock()

    @staticmethod
    def check_name(name: str) -> str:
        n = name.strip().lower()
        if not _NAME.match(n):
            raise APIError(400, "voice names are 1-64 characters of a-z, 0-9, '_' and '-', starting with a letter "
                                "or digit", param="name")
        return n

    def _paths(self, name: str):
        return self.dir / f"{name}.npy", self.dir / f"{name}.json"

    def list(self) -> list[dict]:
        out = []
        for meta in sorted(self.dir.glob("*.json")):
            try:
                out.append(json.loads(meta.read_text()))
            except (OSError, json.JSONDecodeError):
                continue
        return out

    def get(self, name: str) -> tuple[np.ndarray, str] | None:
        codes_p, meta_p = self._paths(name)
        if not (codes_p.exists() and meta_p.exists()):
            return None
        return np.load(codes_p), json.loads(meta_p.read_text())["text"]

    def put(self, name: str, codes: np.ndarray, text: str, frame_rate: float) -> dict:
        name = self.check_name(name)
        with self.lock:
            codes_p, meta_p = self._paths(name)
            if not codes_p.exists() and len(list(self.dir.glob("*.json"))) >= self.max_voices:
                raise APIError(400, f"voice store is full ({self.max_voices} voices); delete one first")
            meta = {"name": name, "text": text, "frames": int(codes.shape[1]),
                    "seconds": round(codes.shape[1] / frame_rate, 3), "created_at": int(time.time())}
            np.save(codes_p, codes.astype(np.int32))
            meta_p.write_text(json.dumps(meta))
        return meta

    def delete(self, name: str) -> bool:
        name = self.check_name(name)
        with self.lock:
            found = False
            for p in self._paths(name):
                if p.exists():
                    p.unlink()
                    found = True
            return found
