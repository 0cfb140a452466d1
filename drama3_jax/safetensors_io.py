"""Streaming safetensors reader/writer with FP8 support (the numpy API of `safetensors` rejects F8_E4M3).

File format: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]},
"__metadata__": {...}}, then the raw little-endian tensor bytes. Tensors are read one at a time from a memory map.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable

import ml_dtypes
import numpy as np

DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "I16": np.dtype(np.int16), "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64), "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsFile:
    """Lazy reader: `names()`, `info(name)` -> (dtype, shape), `get(name)` -> np.ndarray (a copy)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header = header
        self._base = 8 + n
        self._mm = None

    def names(self) -> list[str]:
        return list(self.header)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        h = self.header[name]
        return h["dtype"], tuple(h["shape"])

    def get(self, name: str) -> np.ndarray:
        h = self.header[name]
        if h["dtype"] not in DTYPES:
            raise ValueError(f"{self.path.name}: tensor {name!r} has unsupported dtype {h['dtype']}")
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        b, e = h["data_offsets"]
        raw = self._mm[self._base + b:self._base + e]
        return np.array(raw).view(DTYPES[h["dtype"]]).reshape(h["shape"])

    def close(self):
        self._mm = None


def write_safetensors(path: str | Path, tensors: Iterable[tuple[str, np.ndarray]], metadata: dict | None = None):
    """Write (name, array) pairs in order. Arrays must use a dtype in DTYPES."""
    items = [(n, np.ascontiguousarray(a)) for n, a in tensors]
    header, off = {}, 0
    for n, a in items:
        if a.dtype not in NAMES:
            raise ValueError(f"tensor {n!r}: dtype {a.dtype} cannot be written to safetensors")
        header[n] = {"dtype": NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)  # align the data section to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, a in items:
            f.write(a.tobytes())


class CheckpointReader:
    """A HF checkpoint directory: `model.safetensors.index.json` + shards, or a single `model.safetensors`."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            with open(index) as f:
                self.weight_map: dict[str, str] = json.load(f)["weight_map"]
        elif (self.dir / "model.safetensors").exists():
            self.weight_map = {n: "model.safetensors" for n in SafetensorsFile(self.dir / "model.safetensors").names()}
        else:
            raise FileNotFoundError(f"{self.dir}: no model.safetensors.index.json or model.safetensors")
        self._files: dict[str, SafetensorsFile] = {}

    def _file(self, name: str) -> SafetensorsFile:
        shard = self.weight_map[name]
        if shard not in self._files:
            path = self.dir / shard
            if not path.exists():
                raise FileNotFoundError(f"shard {shard} (holding {name!r}) is missing from {self.dir}")
            self._files[shard] = SafetensorsFile(path)
        return self._files[shard]

    def names(self) -> list[str]:
        return list(self.weight_map)

    def info(self, name: str):
        return self._file(name).info(name)

    def get(self, name: str) -> np.ndarray:
        return self._file(name).get(name)
