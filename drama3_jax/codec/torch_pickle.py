"""Read a `torch.save` state dict (zip format) without torch: tensors come back lazily as numpy arrays.

The zip holds `<root>/data.pkl` (a pickle whose tensors are `torch._utils._rebuild_tensor_v2(storage, offset, size,
stride, ...)` calls on persistent ids ('storage', <dtype>Storage, key, location, numel)) and one raw little-endian
file per storage, `<root>/data/<key>`, stored uncompressed. Only those globals are accepted, so loading runs no code.
"""

from __future__ import annotations

import collections
import pickle
import struct
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np

_STORAGE_DTYPES = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "BoolStorage": np.bool_, "LongStorage": np.int64,
    "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8,
}


class TorchFileError(ValueError):
    """Not a torch zip checkpoint this reader understands."""


class LazyTensor:
    """One tensor of the file: `shape`, `dtype`; `numpy()` reads it (a fresh C-contiguous array)."""

    def __init__(self, archive: TorchArchive, key: str, dtype, offset: int, shape, stride):
        self._archive, self._key = archive, key
        self.dtype, self.shape = np.dtype(dtype), tuple(int(s) for s in shape)
        self._offset, self._stride = int(offset), tuple(int(s) for s in stride)

    def numpy(self) -> np.ndarray:
        flat = self._archive.storage(self._key, self.dtype)
        if not self.shape:
            return flat[self._offset].copy()
        view = np.lib.stride_tricks.as_strided(flat[self._offset:], self.shape,
                                               tuple(s * self.dtype.itemsize for s in self._stride))
        return np.ascontiguousarray(view)


class TorchArchive:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not zipfile.is_zipfile(self.path):
            raise TorchFileError(f"{self.path}: not a zip-format torch checkpoint (re-save it with torch.save)")
        self._zip = zipfile.ZipFile(self.path)
        pkl = [n for n in self._zip.namelist() if n.endswith("/data.pkl")]
        if len(pkl) != 1:
            raise TorchFileError(f"{self.path}: expected one */data.pkl in the archive, found {pkl}")
        self._root = pkl[0][:-len("data.pkl")]
        order = self._root + "byteorder"
        if order in self._zip.namelist() and self._zip.read(order).strip() != b"little":
            raise TorchFileError(f"{self.path}: big-endian checkpoints are not supported")

    def load(self) -> dict:
        return _Unpickler(self, self._zip.open(self._root + "data.pkl")).load()

    def storage(self, key: str, dtype) -> np.ndarray:
        """The whole storage `key` as a flat array, memory-mapped when stored uncompressed."""
        info = self._zip.getinfo(f"{self._root}data/{key}")
        if info.compress_type != zipfile.ZIP_STORED:
            return np.frombuffer(self._zip.read(info), dtype)
        with open(self.path, "rb") as f:
            f.seek(info.header_offset)
            name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        return np.memmap(self.path, dtype=np.dtype(dtype), mode="r", offset=start,
                         shape=(info.file_size // np.dtype(dtype).itemsize,))


def _rebuild_tensor(storage, offset, size, stride, *unused):
    archive, key, dtype = storage
    return LazyTensor(archive, key, dtype, offset, size, stride)


def _rebuild_parameter(data, *unused):
    return data


class _Unpickler(pickle.Unpickler):
    _GLOBALS = {("collections", "OrderedDict"): collections.OrderedDict,
                ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
                ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}

    def __init__(self, archive: TorchArchive, file):
        super().__init__(file)
        self._archive = archive

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) in self._GLOBALS:
            return self._GLOBALS[(module, name)]
        raise TorchFileError(f"{self._archive.path}: unsupported pickled object {module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise TorchFileError(f"{self._archive.path}: unsupported persistent id {pid!r}")
        return self._archive, str(pid[2]), pid[1]


def load_state_dict(path: str | Path) -> dict[str, LazyTensor]:
    """name -> LazyTensor of a torch state dict file; nothing is read until `.numpy()`."""
    sd = TorchArchive(path).load()
    if not isinstance(sd, dict) or not all(isinstance(v, LazyTensor) for v in sd.values()):
        raise TorchFileError(f"{path}: expected a flat state dict of tensors")
    return dict(sd)
