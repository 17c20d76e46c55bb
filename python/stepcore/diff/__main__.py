"""The comparer's command line: python -m stepcore.diff A B [--json] [--max-ulps N] [--all]
[--report out.html].

A and B are two recordings (directories) or two safetensors files. Exit status 0 when
every tensor is identical or within --max-ulps, 1 when any differs (or is missing or
mismatched), 2 on an error: bad arguments, or corrupt or unreadable input, with a message
naming the file and what is wrong. Human output lists the tensors that are not identical
(the first 20; --all lists every tensor) and ends with the first divergence or
`identical: K tensors`; --json prints the dict of stepcore.diff.compare instead.
"""

from __future__ import annotations

import argparse
import json
import sys

from ._compare import compare_detailed
from ._report import write_report
from ._safetensors import FormatError

SHOWN = 20


def _non_negative(text: str) -> int:
    """Parses --max-ulps: a non-negative integer."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {n}")
    return n


def parse_args(argv):
    """Returns the command line's options (argparse exits 2 on bad ones)."""
    p = argparse.ArgumentParser(prog="python -m stepcore.diff",
                                description="Compares two stepcore recordings or two "
                                            "safetensors files bit for bit.")
    p.add_argument("a", metavar="A", help="a recording directory or a safetensors file")
    p.add_argument("b", metavar="B", help="the same kind as A")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--max-ulps", type=_non_negative, default=0,
                   help="accept F32/BF16/F16 differences up to N ulps (no NaN, no Inf)")
    p.add_argument("--all", action="store_true", help="list every tensor, identical ones too")
    p.add_argument("--report", metavar="OUT.html", help="write an HTML report")
    return p.parse_args(argv)


def _where(t) -> str:
    """Returns a tensor's place for a line: 'step S rank R point/name' or the file's name."""
    if t["step"] is None:
        return t["name"]
    return f"step {t['step']} rank {t['rank']} {t['point']}/{t['name']}"


def _line(t, x) -> str:
    """Returns one tensor's line of human output."""
    head = f"{t['status']}: {_where(t)}"
    if t["status"] in ("shape_mismatch", "dtype_mismatch"):
        return f"{head}: A {x['a'][0]} {x['a'][1]}, B {x['b'][0]} {x['b'][1]}"
    if t["differing"] is None:
        return f"{head} {t['dtype']} {t['shape']}"
    s = f"{head} {t['dtype']} {t['shape']}"
    if t["differing"] == 0:
        return s
    s += (f": {t['differing']} of {t['elements']} elements differ ({t['fraction']:.3%})")
    if t["max_ulps"] is not None:
        s += f", max {t['max_ulps']} ulps, median {t['median_ulps']}"
    s += (f"; first at [{t['first_index']}]: A {t['a_hex']} ({t['a_value']}), "
          f"B {t['b_hex']} ({t['b_value']})")
    classes = [f"{k} {t[k]}" for k in ("nan_vs_number", "nan_payload", "signed_zero", "inf")
               if t[k]]
    if classes:
        s += "; " + ", ".join(classes)
    return s


def _human(result, extras, kind, runs, max_ulps, show_all) -> str:
    """Returns the human-readable output."""
    out = []
    ra, rb = runs
    if ra is not None:
        for k in sorted(set(ra) | set(rb)):
            if ra.get(k) != rb.get(k):
                out.append(f"run metadata {k}: A {ra.get(k)!r}, B {rb.get(k)!r}")
    listed = [(t, x) for t, x in zip(result["tensors"], extras)
              if show_all or t["status"] != "identical"]
    limit = len(listed) if show_all else SHOWN
    out.extend(_line(t, x) for t, x in listed[:limit])
    if len(listed) > limit:
        out.append(f"... and {len(listed) - limit} more not identical (--all lists every "
                   "tensor)")
    s = result["summary"]
    out.append("summary: " + ", ".join(f"{k} {v}" for k, v in s.items()))
    fd = result["first_divergence"]
    if fd is not None:
        if kind == "recording":
            out.append(f"first divergence: step {fd['step']}, point {fd['point']}, name "
                       f"{fd['name']}, rank {fd['rank']}")
        else:
            out.append(f"first divergence: tensor {fd['name']}")
    elif result["identical"]:
        out.append(f"identical: {s['tensors']} tensors")
    else:
        out.append(f"within tolerance: {s['tensors']} tensors ({s['identical']} identical, "
                   f"{s['within_tolerance']} within {max_ulps} ulps)")
    return "\n".join(out)


def main(argv=None) -> int:
    """Runs the comparer; returns the exit status (0 same, 1 different, 2 error)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result, extras, kind, runs = compare_detailed(args.a, args.b, args.max_ulps)
    except (FormatError, ValueError, OSError, ImportError) as e:
        print(f"stepcore.diff: error: {e}", file=sys.stderr)
        return 2
    if args.report:
        try:
            write_report(args.report, result, extras, kind, args.a, args.b, args.max_ulps)
        except OSError as e:
            print(f"stepcore.diff: error: the report {args.report} cannot be written "
                  f"({e.strerror or e})", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(_human(result, extras, kind, runs, args.max_ulps, args.all))
    return result["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
