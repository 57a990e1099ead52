"""Memory-mapped reading of safetensors files (single or sharded), tensor by tensor.

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then
raw data. Reading through numpy.memmap means a 60 GB checkpoint costs no host memory beyond the tensor being
converted; bfloat16 and float8 come from ml_dtypes (a jax dependency).
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int      # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict]:
    """Return ({name: TensorInfo}, metadata) of one .safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", {}) or {}
    base = 8 + n
    out = {}
    for name, h in header.items():
        s, e = h["data_offsets"]
        out[name] = TensorInfo(path, h["dtype"], tuple(h["shape"]), base + s, base + e)
    return out, meta


def index_checkpoint(ckpt_dir: str) -> dict[str, TensorInfo]:
    """All tensors of a checkpoint directory: `model.safetensors.index.json` shards, or every *.safetensors."""
    idx = os.path.join(ckpt_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(p for p in os.listdir(ckpt_dir) if p.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt_dir}: no *.safetensors files (and no model.safetensors.index.json)")
    tensors: dict[str, TensorInfo] = {}
    for fn in files:
        path = os.path.join(ckpt_dir, fn)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{ckpt_dir}: shard {fn} named in model.safetensors.index.json is missing")
        t, _ = read_header(path)
        tensors.update(t)
    return tensors


def load_tensor(info: TensorInfo) -> np.ndarray:
    """Memory-mapped view of one tensor (no copy until it is converted)."""
    if info.dtype not in _DTYPES:
        raise ValueError(f"{info.file}: tensor dtype {info.dtype} is not supported")
    dt = np.dtype(_DTYPES[info.dtype])
    count = int(np.prod(info.shape)) if info.shape else 1
    if count * dt.itemsize != info.nbytes:
        raise ValueError(f"{info.file}: tensor byte range {info.nbytes} does not match {info.shape} x {info.dtype}")
    arr = np.memmap(info.file, dtype=dt, mode="r", offset=info.start, shape=(count,))
    return arr.reshape(info.shape)


def save_file(tensors: dict[str, np.ndarray], path: str, metadata: dict | None = None) -> None:
    """Write a .safetensors file (used by tests and by the converter)."""
    inv = {np.dtype(v): k for k, v in _DTYPES.items()}
    header, off, blobs = {}, 0, []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        b = a.tobytes()
        header[name] = {"dtype": inv[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
