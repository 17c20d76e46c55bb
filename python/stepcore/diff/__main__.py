"""The comparer's command line: python -m stepcore.diff A B [--json] [--max-ulps N] [--all]
[--report out.html].

A and B are two recordings (directories) or two safetensors files. Exit status 0 when
every tensor is identical or within --max-ulps, 1 when any differs (or is missing or
mismatched), 2 on an error: bad arguments, or corrupt or unreadable input, with a message
naming the file and what is wrong. The comparison and its human output are the C++
stepcore-diff's (through stepcore._core): the differing run metadata, then the table of
the tensors that are not identical (--all: every tensor) and the summary (the first
divergence and the counts, `identical: K tensors`, or `within tolerance: ...`); --json
prints the dict of stepcore.diff.compare instead.
"""

from __future__ import annotations

import argparse
import json
import sys

from ._compare import _compare, _extras
from ._report import write_report
from ._safetensors import FormatError


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


def _run_lines(runs) -> list:
    """Returns a line per run metadata key whose values differ between A and B."""
    ra, rb = runs
    if ra is None or rb is None:
        return []
    return [f"run metadata {k}: A {ra.get(k)!r}, B {rb.get(k)!r}"
            for k in sorted(set(ra) | set(rb)) if ra.get(k) != rb.get(k)]


def main(argv=None) -> int:
    """Runs the comparer; returns the exit status (0 same, 1 different, 2 error)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = _compare(args.a, args.b, args.max_ulps, args.all)
    except (FormatError, ValueError, OSError, ImportError) as e:
        print(f"stepcore.diff: error: {e}", file=sys.stderr)
        return 2
    result = out["result"]
    if args.report:
        try:
            write_report(args.report, result, _extras(out), out["kind"], args.a, args.b,
                         args.max_ulps)
        except OSError as e:
            print(f"stepcore.diff: error: the report {args.report} cannot be written "
                  f"({e.strerror or e})", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        sys.stdout.write("".join(line + "\n" for line in _run_lines(out["runs"])) +
                         out["human"])
    return result["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
