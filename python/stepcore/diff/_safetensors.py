"""The safetensors file layout, read and written with numpy alone (no safetensors package).

A file is an 8-byte little-endian u64 header length N, N bytes of a JSON object mapping
each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to
the byte after the header) plus an optional "__metadata__" of strings, then the raw
little-endian data. `read_file` checks every rule before any tensor is used and raises
`FormatError` naming the file and the problem; each tensor is read from the file when it
is asked for (never mapped), so large files are not loaded whole. Comparing is the C++
comparer's (stepcore._core), not this module's.
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

__all__ = ["DTYPES", "FormatError", "SafetensorsFile", "TensorInfo", "ULP_DTYPES",
           "read_file", "write_file"]

# name -> (bytes per element, numpy dtype of the raw bits (unsigned, little-endian),
#          numpy dtype of the values or None when numpy has none (BF16))
DTYPES = {
    "F64": (8, "<u8", "<f8"),
    "F32": (4, "<u4", "<f4"),
    "BF16": (2, "<u2", None),
    "F16": (2, "<u2", "<f2"),
    "I64": (8, "<u8", "<i8"),
    "I32": (4, "<u4", "<i4"),
    "I16": (2, "<u2", "<i2"),
    "I8": (1, "u1", "i1"),
    "U8": (1, "u1", "u1"),
    "BOOL": (1, "u1", "?"),
}
ULP_DTYPES = ("F32", "BF16", "F16")  # compared in ulps; the others bit for bit only

_MAX_HEADER = 100 << 20  # a header longer than this is taken as corrupt


class FormatError(ValueError):
    """A file or recording that breaks the format (the message names it and the problem)."""


class TensorInfo:
    """One tensor of a file: name, dtype, shape, elements and its byte range in the data."""

    __slots__ = ("name", "dtype", "shape", "numel", "begin", "end")

    def __init__(self, name, dtype, shape, begin, end):
        """Stores the checked fields."""
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)
        self.begin, self.end = begin, end
        n = 1
        for d in self.shape:
            n *= d
        self.numel = n

    def __repr__(self):
        """Returns the tensor's fields as one line."""
        return (f"TensorInfo({self.name!r}, {self.dtype}, {list(self.shape)}, "
                f"[{self.begin}, {self.end}])")


def _is_int(x) -> bool:
    """Returns whether `x` is a JSON integer (not a bool)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _no_duplicate_keys(where):
    """Returns a json object_pairs_hook that refuses a key given twice, naming `where`."""
    def hook(pairs):
        """Builds the object, refusing a repeated key."""
        out = {}
        for k, v in pairs:
            if k in out:
                raise FormatError(f"{where}: duplicate key {k!r} in the JSON")
            out[k] = v
        return out
    return hook


class SafetensorsFile:
    """A checked safetensors file: its tensors (in header order), metadata and data."""

    def __init__(self, path, tensors, metadata, data_start, size):
        """Stores what read_file checked; tensors are read when asked for."""
        self.path = os.fspath(path)
        self.tensors = tensors  # name -> TensorInfo, in the header's order
        self.metadata = metadata
        self._data_start = data_start
        self._size = size

    def names_by_offset(self):
        """Returns the tensor names in ascending order of their data offset."""
        return [t.name for t in sorted(self.tensors.values(), key=lambda t: (t.begin, t.end))]

    def raw(self, name) -> np.ndarray:
        """Returns tensor `name` as a flat array of its unsigned bit patterns, read from the
        file (never mapped: a file truncated meanwhile is a FormatError, not a SIGBUS)."""
        t = self.tensors[name]
        bits = np.dtype(DTYPES[t.dtype][1])
        if t.numel == 0:
            return np.zeros(0, bits)
        n = t.end - t.begin
        buf = bytearray(n)
        view = memoryview(buf)
        try:
            with open(self.path, "rb", buffering=0) as f:
                done = 0
                while done < n:
                    f.seek(self._data_start + t.begin + done)
                    got = f.readinto(view[done:])
                    if not got:
                        raise FormatError(f"{self.path}: ends before tensor {name!r} is read "
                                          "whole (truncated while being read?)")
                    done += got
        except OSError as e:
            raise FormatError(f"{self.path}: cannot be read ({e.strerror or e})") from None
        return np.frombuffer(buf, bits)

    def array(self, name) -> np.ndarray:
        """Returns tensor `name` shaped, as values (BF16: its uint16 bit patterns)."""
        t = self.tensors[name]
        values = DTYPES[t.dtype][2]
        raw = self.raw(name)
        return (raw if values is None else raw.view(values)).reshape(t.shape)


def read_file(path) -> SafetensorsFile:
    """Reads and checks a safetensors file's header; raises FormatError naming it."""
    where = os.fspath(path)
    try:
        size = os.path.getsize(where)
        with open(where, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"{where}: the file has {len(head)} bytes, shorter than the "
                                  "8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise FormatError(f"{where}: the header length {n} runs past the end of the "
                                  f"file ({size} bytes)")
            if n > _MAX_HEADER:
                raise FormatError(f"{where}: the header length {n} is over {_MAX_HEADER} bytes")
            text = f.read(n)
    except FormatError:
        raise
    except IsADirectoryError:
        raise FormatError(f"{where}: is a directory, not a safetensors file") from None
    except OSError as e:
        raise FormatError(f"{where}: cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicate_keys(where))
    except FormatError:
        raise
    except (UnicodeDecodeError, ValueError) as e:
        raise FormatError(f"{where}: the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{where}: the header is a JSON {type(header).__name__}, "
                          "not an object")
    data_size = size - 8 - n
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise FormatError(f"{where}: '__metadata__' must be an object of strings")
    tensors = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_info(where, name, e, data_size)
    ranges = sorted(tensors.values(), key=lambda t: (t.begin, t.end))
    for a, b in zip(ranges, ranges[1:]):
        if b.begin < a.end:
            raise FormatError(f"{where}: tensor '{b.name}' (data_offsets [{b.begin}, {b.end}]) "
                              f"overlaps tensor '{a.name}' ([{a.begin}, {a.end}])")
    return SafetensorsFile(where, tensors, dict(metadata), 8 + n, size)


def _tensor_info(where, name, e, data_size) -> TensorInfo:
    """Checks one header entry and returns its TensorInfo (FormatError naming it)."""
    what = f"{where}: tensor '{name}'"
    if not isinstance(e, dict):
        raise FormatError(f"{what}: the entry is not an object")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in e:
            raise FormatError(f"{what}: the entry has no '{field}'")
    dtype = e["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FormatError(f"{what}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    shape = e["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise FormatError(f"{what}: bad shape {shape!r} (a list of non-negative integers)")
    offs = e["data_offsets"]
    if not isinstance(offs, list) or len(offs) != 2 or not all(
            _is_int(x) and x >= 0 for x in offs):
        raise FormatError(f"{what}: bad data_offsets {offs!r} (two non-negative integers)")
    begin, end = offs
    if begin > end:
        raise FormatError(f"{what}: data_offsets begin {begin} > end {end}")
    if end > data_size:
        raise FormatError(f"{what}: data_offsets [{begin}, {end}] out of range (the data has "
                          f"{data_size} bytes)")
    info = TensorInfo(name, dtype, shape, begin, end)
    need = info.numel * DTYPES[dtype][0]
    if end - begin != need:
        raise FormatError(f"{what}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                          f"but {dtype} {shape} needs {need}")
    return info


def write_file(path, tensors, metadata=None) -> None:
    """Writes [(name, dtype, shape, raw little-endian bytes)] as safetensors, atomically."""
    # The data follows the header in the given order without gaps; the header is padded
    # with spaces to a multiple of 8 bytes so the data starts aligned. The file is written
    # to `path` + ".tmp", flushed to disk and renamed over `path`.
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape, data in tensors:
        if dtype not in DTYPES:
            raise ValueError(f"stepcore.diff: tensor '{name}': unknown dtype {dtype!r}")
        if name in header:
            raise ValueError(f"stepcore.diff: tensor '{name}' is given twice")
        n = 1
        for d in shape:
            n *= d
        if len(data) != n * DTYPES[dtype][0]:
            raise ValueError(f"stepcore.diff: tensor '{name}': {len(data)} bytes for "
                             f"{dtype} {list(shape)}")
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, data in tensors:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
