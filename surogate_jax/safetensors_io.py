"""Memory-mapped safetensors reading and streaming writing, with bf16/fp8 through ml_dtypes.

Why our own: loading must validate every header against the file size (a truncated download gives a
clear `ModelLoadError`, not a segfault or garbage), must read bf16 without torch, and must hand out
one tensor at a time as a zero-copy view so the loader never holds two copies of the model. The
format (https://github.com/huggingface/safetensors): u64 little-endian header length, a JSON header
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the raw bytes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

from .errors import ModelLoadError

DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """One .safetensors file: validated header, tensors as read-only memory-mapped views."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: weight file is missing")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelLoadError(f"{self.path}: truncated ({size} bytes, no safetensors header)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or 8 + n > size:
                raise ModelLoadError(
                    f"{self.path}: truncated or not a safetensors file (header of {n} bytes, "
                    f"file of {size} bytes)"
                )
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ModelLoadError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise ModelLoadError(f"{self.path}: corrupt safetensors header (a JSON {type(header).__name__}, "
                                 "not an object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self._start = 8 + n
        self.tensors: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ModelLoadError(f"{self.path}: tensor {name!r} has an unreadable header entry {info!r}") from None
            if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has inconsistent offsets {info!r}")
            if self._start + end > size:
                raise ModelLoadError(
                    f"{self.path}: truncated: tensor {name!r} ends at byte {self._start + end} "
                    f"but the file has {size} bytes"
                )
            self.tensors[name] = (dtype, shape, begin, end)
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r") if size else None

    def get(self, name: str) -> np.ndarray:
        dtype, shape, begin, end = self.tensors[name]
        if begin == end:
            return np.zeros(shape, dtype)
        raw = self._mmap[self._start + begin : self._start + end]
        return raw.view(dtype).reshape(shape)


class CheckpointReader:
    """All weight files of an HF model directory: sharded with an index, or one file."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
                raise ModelLoadError(f"{index}: corrupt index file ({e!r})") from None
            missing = [f for f in files if not (self.dir / f).is_file()]
            if missing:
                raise ModelLoadError(f"{self.dir}: missing shard(s) listed in {index.name}: {missing}")
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            if not files:
                other = sorted(p.name for p in self.dir.glob("*.bin")) + sorted(p.name for p in self.dir.glob("*.pt"))
                hint = f" (found {other}: convert to safetensors first)" if other else ""
                raise ModelLoadError(f"{self.dir}: no *.safetensors weight files{hint}")
        self.files = {f: SafetensorsFile(self.dir / f) for f in files}
        self.where = {name: f for f, st in self.files.items() for name in st.tensors}
        if index.is_file():
            lost = sorted(n for n, f in weight_map.items() if self.where.get(n) != f)
            if lost:
                raise ModelLoadError(f"{self.dir}: tensors listed in the index but absent from their shard: {lost[:5]}")

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise ModelLoadError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        return self.files[self.where[name]].get(name)

    def names(self) -> Iterable[str]:
        return self.where.keys()


def _header(entries: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict) -> tuple[bytes, int]:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep the data 8-byte aligned
    return struct.pack("<Q", len(blob)) + blob, offset


def write_file(path: Path, entries, arrays: Iterable[np.ndarray], metadata: dict | None = None) -> int:
    """Writes tensors whose (name, dtype, shape) are known up front; `arrays` streams their data in
    the same order, so only one tensor need be in host memory at a time. Returns the data size."""
    head, total = _header(entries, metadata or {"format": "pt"})
    with open(path, "wb") as f:
        f.write(head)
        for (name, dtype, shape), arr in zip(entries, arrays, strict=True):
            arr = np.ascontiguousarray(arr, dtype=dtype)
            if arr.shape != tuple(shape):
                raise ValueError(f"{name}: expected shape {shape}, got {arr.shape}")
            f.write(arr.tobytes())
    return total
