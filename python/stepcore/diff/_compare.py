"""The comparer: two recordings (or two safetensors files) bit for bit, tensor by tensor.

Tensors are paired by (step, rank, point, name) (files: by tensor name) and walked in A's
order (files: ascending data offset in A), then the ones only B has in B's order. Each
pair gets a status (identical, different, within_tolerance, missing_in_a, missing_in_b,
shape_mismatch, dtype_mismatch) and, when both sides have the same dtype and shape, the
count and fraction of differing elements (any bit differs), the first differing flat
index with both values, ulp distances for F32/BF16/F16 and the class differences among
the differing elements. Arrays are read in chunks from memory-mapped files.

Ulp distance: each value's bits map to an ordered integer (non-negative: the bits;
negative: -(bits & magnitude mask)), so +0 and -0 both map to 0 and the distance across
zero is the sum of both sides' distances to zero; the distance is |o(a) - o(b)|, and
pairs where either side is NaN have none. ``max_ulps`` is the largest distance over all
pairs without a NaN (0 when none differ); ``median_ulps`` is the lower median (the
element at index (k - 1) // 2 of the k sorted distances) of the differing pairs without
a NaN (0 when k is 0). Both are null for the bitwise-only dtypes.

Class counts (differing elements only): ``nan_vs_number`` one side NaN, ``nan_payload``
both NaN with other bits, ``signed_zero`` +0 against -0, ``inf`` neither NaN and at least
one side infinite. With ``max_ulps`` N > 0 a tensor of an ulp-aware dtype whose
differences are all within N ulps and involve no NaN and no infinity is
``within_tolerance``; with N = 0 nothing is.
"""

from __future__ import annotations

import os

import numpy as np

from ._recording import read_recording
from ._safetensors import DTYPES, ULP_DTYPES, FormatError, read_file

__all__ = ["compare", "compare_detailed"]

CHUNK = 1 << 22  # elements per chunk
HIST_BUCKETS = 34  # log2 buckets of ulp distances: 0, 1, [2,4), ..., [2^32, 2^33)

# dtype -> (signed view, magnitude mask, exponent mask == infinity's magnitude)
_FLOAT = {"F32": ("<i4", 0x7FFFFFFF, 0x7F800000),
          "BF16": ("<i2", 0x7FFF, 0x7F80),
          "F16": ("<i2", 0x7FFF, 0x7C00)}

_OK = ("identical", "within_tolerance")


class _Stats:
    """What one pair of equal-dtype, equal-shape tensors gives."""

    def __init__(self):
        """Starts with nothing counted."""
        self.differing = 0
        self.first_index = None
        self.max_ulps = 0
        self.dists = []  # uint64 arrays: distances of differing pairs without a NaN
        self.hist = np.zeros(HIST_BUCKETS, np.int64)
        self.nan_vs_number = self.nan_payload = self.signed_zero = self.inf = 0


def _ordered(bits_signed, mag):
    """Returns the ordered integers (int64) of signed bit patterns: negatives -(bits & mag)."""
    s = bits_signed.astype(np.int64)
    return np.where(s >= 0, s, -(s & mag))


def _chunk_stats(st: _Stats, dtype: str, ca, cb, offset: int) -> None:
    """Adds one chunk (raw unsigned arrays of equal length) to `st`."""
    diff = ca != cb
    nd = int(np.count_nonzero(diff))
    if nd == 0:
        return
    if st.first_index is None:
        st.first_index = offset + int(np.argmax(diff))
    st.differing += nd
    if dtype not in _FLOAT:
        return
    signed, mag, expo = _FLOAT[dtype]
    da = ca[diff].view(signed)
    db = cb[diff].view(signed)
    ma = da.astype(np.int64) & mag
    mb = db.astype(np.int64) & mag
    nan_a, nan_b = ma > expo, mb > expo
    st.nan_vs_number += int(np.count_nonzero(nan_a != nan_b))
    st.nan_payload += int(np.count_nonzero(nan_a & nan_b))
    st.signed_zero += int(np.count_nonzero((ma == 0) & (mb == 0)))
    num = ~(nan_a | nan_b)
    st.inf += int(np.count_nonzero(num & ((ma == expo) | (mb == expo))))
    d = np.abs(_ordered(da[num], mag) - _ordered(db[num], mag)).astype(np.uint64)
    if d.size:
        st.max_ulps = max(st.max_ulps, int(d.max()))
        st.dists.append(d)
        _, e = np.frexp(d.astype(np.float64))  # d = f * 2^e, f in [0.5, 1): e = bit length
        st.hist += np.bincount(e.astype(np.int64), minlength=HIST_BUCKETS)[:HIST_BUCKETS]


def _lower_median(parts) -> int:
    """Returns the lower median of the concatenated distances (0 when there are none)."""
    k = sum(p.size for p in parts)
    if k == 0:
        return 0
    d = np.concatenate(parts) if len(parts) > 1 else parts[0]
    i = (k - 1) // 2
    return int(np.partition(d, i)[i])


def _hex(dtype: str, bits: int) -> str:
    """Returns the bit pattern as 0x-prefixed hex, two digits per byte."""
    return f"0x{bits:0{2 * DTYPES[dtype][0]}x}"


def _value(dtype: str, bits: int):
    """Returns the value of a bit pattern for JSON: a number (floats: the exact value of
    the element, printed as the shortest round trip of that double), "nan", "inf" or
    "-inf"; true/false for BOOL (what the C++ stepcore-diff emits)."""
    if dtype in ("F32", "BF16", "F16", "F64"):
        if dtype == "BF16":
            x = np.array([bits << 16], np.uint32).view(np.float32)[0]
        else:
            x = np.array([bits], DTYPES[dtype][1]).view(DTYPES[dtype][2])[0]
        if np.isnan(x):
            return "nan"
        if np.isinf(x):
            return "inf" if x > 0 else "-inf"
        return float(x)
    if dtype == "BOOL":
        return bits != 0
    return int(np.array([bits], DTYPES[dtype][1]).view(DTYPES[dtype][2])[0])


def _compare_pair(dtype, ra, rb, max_ulps):
    """Compares two flat raw arrays of one dtype; returns (fields, histogram or None)."""
    st = _Stats()
    n = ra.size
    for start in range(0, n, CHUNK):
        _chunk_stats(st, dtype, np.asarray(ra[start:start + CHUNK]),
                     np.asarray(rb[start:start + CHUNK]), start)
    ulp = dtype in ULP_DTYPES
    out = {"elements": int(n), "differing": st.differing,
           "fraction": (st.differing / n) if n else 0.0,
           "max_ulps": st.max_ulps if ulp else None,
           "median_ulps": _lower_median(st.dists) if ulp else None,
           "first_index": st.first_index, "a_hex": None, "b_hex": None,
           "a_value": None, "b_value": None,
           "nan_vs_number": st.nan_vs_number if ulp else None,
           "nan_payload": st.nan_payload if ulp else None,
           "signed_zero": st.signed_zero if ulp else None, "inf": st.inf if ulp else None}
    if st.first_index is not None:
        i = st.first_index
        av, bv = int(ra[i]), int(rb[i])
        out.update(a_hex=_hex(dtype, av), b_hex=_hex(dtype, bv), a_value=_value(dtype, av),
                   b_value=_value(dtype, bv))
    if st.differing == 0:
        status = "identical"
    elif (ulp and max_ulps > 0 and st.nan_vs_number == 0 and st.nan_payload == 0
          and st.inf == 0 and st.max_ulps <= max_ulps):
        status = "within_tolerance"
    else:
        status = "different"
    return status, out, (st.hist if ulp and st.differing else None)


_NULL_FIELDS = ("differing", "fraction", "max_ulps", "median_ulps", "first_index", "a_hex",
                "b_hex", "a_value", "b_value", "nan_vs_number", "nan_payload", "signed_zero",
                "inf")


def _tensor_entry(ident, key, a, b, max_ulps):
    """Returns (JSON entry, extra) for one pair; a and b are (dtype, shape, raw()) or None."""
    step, rank, point, name = ident
    entry = {"step": step, "rank": rank, "point": point, "name": name, "key": key}
    extra = {"hist": None, "a": None, "b": None}
    if a is not None:
        extra["a"] = (a[0], list(a[1]))
    if b is not None:
        extra["b"] = (b[0], list(b[1]))
    side = a if a is not None else b
    dtype, shape = side[0], list(side[1])
    numel = 1
    for d in shape:
        numel *= d
    base = dict(dtype=dtype, shape=shape, elements=numel, **{k: None for k in _NULL_FIELDS})
    if a is None or b is None:
        entry.update(status="missing_in_a" if a is None else "missing_in_b", **base)
    elif a[0] != b[0]:
        entry.update(status="dtype_mismatch", **base)
    elif list(a[1]) != list(b[1]):
        entry.update(status="shape_mismatch", **base)
    else:
        status, fields, hist = _compare_pair(dtype, a[2](), b[2](), max_ulps)
        entry.update(status=status, dtype=dtype, shape=shape, **fields)
        extra["hist"] = hist
    order = ("step", "rank", "point", "name", "key", "status", "dtype", "shape", "elements",
             "differing", "fraction", "max_ulps", "median_ulps", "first_index", "a_hex",
             "b_hex", "a_value", "b_value", "nan_vs_number", "nan_payload", "signed_zero",
             "inf")
    return {k: entry[k] for k in order}, extra


def _kind(path) -> str:
    """Returns 'recording' or 'file' for an input path (FormatError when it does not exist)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        return "recording"
    if os.path.exists(p):
        return "file"
    raise FormatError(f"{p}: does not exist")


def _pairs(a, b):
    """Yields (ident, key, a side, b side) in comparison order, reading both inputs."""
    ka, kb = _kind(a), _kind(b)
    if ka != kb:
        raise FormatError(f"{os.fspath(a)} is a {ka} and {os.fspath(b)} a {kb}: compare two "
                          "recordings (directories) or two safetensors files")
    if ka == "file":
        fa, fb = read_file(a), read_file(b)

        def side(f, name):
            """The tensor's (dtype, shape, raw reader)."""
            t = f.tensors[name]
            return (t.dtype, t.shape, lambda: f.raw(name))
        order = fa.names_by_offset()
        out = [((None, None, None, n), n, side(fa, n),
                side(fb, n) if n in fb.tensors else None) for n in order]
        out += [((None, None, None, n), n, None, side(fb, n))
                for n in fb.names_by_offset() if n not in fa.tensors]
        return ka, out, (None, None)
    ra, rb = read_recording(a), read_recording(b)

    def ident(e):
        """The entry's pairing key."""
        return (e["step"], e["rank"], e["point"], e["name"])

    def side(r, e):
        """The entry's (dtype, shape, raw reader)."""
        return (e["dtype"], e["shape"], lambda: r.file_of(e).raw(e["key"]))
    by_b = {ident(e): e for e in rb.entries}
    in_a = set()
    out = []
    for e in ra.entries:
        i = ident(e)
        in_a.add(i)
        eb = by_b.get(i)
        out.append((i, e["key"], side(ra, e), side(rb, eb) if eb is not None else None))
    out += [(ident(e), e["key"], None, side(rb, e)) for e in rb.entries if ident(e) not in in_a]
    return ka, out, (ra.run, rb.run)


def compare_detailed(a, b, max_ulps=0):
    """Returns (compare()'s dict, per-tensor extras, the inputs' kind, (A's run, B's run))."""
    # extras: each tensor's ulp histogram (or None) and both sides' (dtype, shape)
    if not isinstance(max_ulps, int) or isinstance(max_ulps, bool) or max_ulps < 0:
        raise ValueError(f"stepcore.diff: 'max_ulps' must be a non-negative integer, got "
                         f"{max_ulps!r}")
    kind, pairs, runs = _pairs(a, b)
    tensors, extras = [], []
    for ident, key, sa, sb in pairs:
        entry, extra = _tensor_entry(ident, key, sa, sb, max_ulps)
        tensors.append(entry)
        extras.append(extra)
    first = next((t for t in tensors if t["status"] not in _OK), None)
    count = {s: sum(1 for t in tensors if t["status"] == s)
             for s in ("identical", "different", "within_tolerance", "missing_in_a",
                       "missing_in_b", "shape_mismatch", "dtype_mismatch")}
    result = {
        "identical": count["identical"] == len(tensors),
        "exit_status": 0 if first is None else 1,
        "first_divergence": None if first is None else
        {k: first[k] for k in ("step", "point", "name", "rank")},
        "tensors": tensors,
        "summary": {"tensors": len(tensors), "identical": count["identical"],
                    "different": count["different"],
                    "within_tolerance": count["within_tolerance"],
                    "missing_in_a": count["missing_in_a"],
                    "missing_in_b": count["missing_in_b"],
                    "shape_mismatch": count["shape_mismatch"],
                    "dtype_mismatch": count["dtype_mismatch"]},
    }
    return result, extras, kind, runs


def compare(a, b, max_ulps=0) -> dict:
    """Compares two recordings or two safetensors files; returns the --json dict."""
    return compare_detailed(a, b, max_ulps)[0]
