#!/usr/bin/python3
"""Minimal, dependency-free reader/writer for the safetensors file format.

Written by hand (no `safetensors` package) so the fixture generators only need
numpy. Format:
    u64 little-endian N | N bytes of JSON header | raw little-endian tensor data
The header maps tensor name -> {"dtype", "shape", "data_offsets": [begin, end]}
with offsets relative to the start of the data section, plus an optional
"__metadata__" dict of string -> string. The header is padded with spaces to a
multiple of 8 so the data section starts 8-byte aligned (lets C++ readers cast
the mmapped data directly to double/int64 pointers).
"""
import json
import struct

import numpy as np

# Only the dtypes tally's tests need. Keys are safetensors dtype strings.
_DTYPES = {
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
}


def _st_dtype(arr):
    # Map by (kind, itemsize) so both native and explicit little-endian numpy
    # dtypes are accepted; bytes are always written little-endian in save().
    key = {("f", 4): "F32", ("f", 8): "F64", ("i", 4): "I32", ("i", 8): "I64"}
    st = key.get((arr.dtype.kind, arr.dtype.itemsize))
    if st is None:
        raise TypeError(f"unsupported dtype {arr.dtype}")
    return st


def save(path, tensors, metadata=None):
    """Write dict name -> numpy array to `path`. Tensors are laid out in
    insertion order (deterministic output => stable diffs when regenerating)."""
    header = {}
    blobs = []
    offset = 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        st = _st_dtype(arr)
        # Force C-contiguous little-endian bytes; shape [] scalars are allowed.
        data = np.ascontiguousarray(arr, dtype=_DTYPES[st]).tobytes()
        header[name] = {
            "dtype": st,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    if metadata:
        # The spec requires string values in __metadata__.
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * ((8 - len(hbytes) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for b in blobs:
            f.write(b)


def load(path):
    """Return (dict name -> numpy array, metadata dict). Validates that the
    data offsets tile the data section exactly, mirroring what the C++ reader
    should check."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", {})
    out = {}
    spans = []
    for name, info in header.items():
        dt = _DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if e - b != count * dt.itemsize:
            raise ValueError(f"{name}: byte span {e - b} != {count} * {dt.itemsize}")
        out[name] = np.frombuffer(data[b:e], dtype=dt).reshape(shape).copy()
        spans.append((b, e))
    spans.sort()
    pos = 0
    for b, e in spans:
        if b != pos:
            raise ValueError("data offsets are not contiguous")
        pos = e
    if pos != len(data):
        raise ValueError("trailing bytes after last tensor")
    return out, metadata


def roundtrip_check(path, tensors, metadata=None):
    """Reload `path` and assert it equals what we meant to write."""
    loaded, meta = load(path)
    assert list(loaded.keys()) == list(tensors.keys()), "tensor set/order mismatch"
    for k, v in tensors.items():
        v = np.asarray(v)
        w = loaded[k]
        assert w.shape == v.shape, (k, w.shape, v.shape)
        assert _st_dtype(w) == _st_dtype(v), (k, w.dtype, v.dtype)
        assert np.array_equal(w, v), k
    if metadata:
        assert meta == {str(a): str(b) for a, b in metadata.items()}
    return loaded, meta
