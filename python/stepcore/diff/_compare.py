"""The comparer: stepcore-diff's C++ comparer (diff/) through stepcore._core.

`compare(a, b, max_ulps=0)` compares two recordings or two safetensors files bit for bit
and returns the dict of ``stepcore-diff --json`` (docs/diff.md, "JSON output"); this
package has no comparison of its own. Tensors are paired by (step, rank, point, name)
(files: by name), a sharded tensor recorded with its placement is gathered whole first,
and each pair gets a status, the differing elements, ulp distances (F32, BF16, F16) and
class differences, computed by the C++ code. A bad input raises FormatError naming the
file and the problem; the files are read into memory, so one truncated while it is read
is such an error too, never a crash.
"""

from __future__ import annotations

import json
import os

from ._safetensors import FormatError

__all__ = ["compare", "compare_detailed"]


def _binding():
    """Returns stepcore._core.diff_compare, or raises ImportError saying why it is absent."""
    from .. import _core

    f = getattr(_core, "diff_compare", None)
    if f is None:
        raise ImportError("stepcore.diff: this stepcore._core was built without the comparer "
                          "(stepcore-diff's library needs nlohmann-json at build time: Debian "
                          "nlohmann-json3-dev, tools/install-deps.sh); recording works, "
                          "comparing does not")
    return f, _core


def _compare(a, b, max_ulps=0, show_all=False) -> dict:
    """Runs the C++ comparer; returns its JSON object: kind, runs, result, details, human
    (stepcore-diff's table and summary; every tensor listed with show_all)."""
    if not isinstance(max_ulps, int) or isinstance(max_ulps, bool) or max_ulps < 0:
        raise ValueError(f"stepcore.diff: 'max_ulps' must be a non-negative integer, got "
                         f"{max_ulps!r}")
    paths = []
    for name, p in (("a", a), ("b", b)):
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(f"stepcore.diff: '{name}' must be a path, got {type(p).__name__}")
        paths.append(os.fspath(p))
    f, core = _binding()
    try:
        text = f(paths[0], paths[1], max_ulps if max_ulps > 0 else None, 0, bool(show_all))
    except core.DiffInputError as e:
        raise FormatError(str(e)) from None
    except ValueError as e:  # A and B of different kinds
        raise FormatError(f"stepcore.diff: {e}") from None
    return json.loads(text)


def _extras(out):
    """Returns compare_detailed's extras of a _compare object."""
    return [{"hist": d["hist"], "a": None if d["a"] is None else tuple(d["a"]),
             "b": None if d["b"] is None else tuple(d["b"]), "shards": d["shards"]}
            for d in out["details"]]


def compare_detailed(a, b, max_ulps=0):
    """Returns (compare()'s dict, per-tensor extras, the inputs' kind, (A's run, B's run)).

    extras: one dict per tensor with "hist" (the ulp distances' 34 log2 buckets: [0]
    distance 0, [1] 1, [2] 2-3, ...; None unless a differing tensor of an ulp-aware
    dtype), "a" and "b" (each side's (dtype, shape), None when missing) and "shards"
    (shards gathered). kind: "recording" or "file".
    """
    out = _compare(a, b, max_ulps)
    runs = out["runs"]
    return out["result"], _extras(out), out["kind"], (runs[0], runs[1])


def compare(a, b, max_ulps=0) -> dict:
    """Compares two recordings or two safetensors files; returns the --json dict."""
    return compare_detailed(a, b, max_ulps)[0]
