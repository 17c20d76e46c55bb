#!/usr/bin/env python3
"""Checks what the CUDA kernels cost each thread, from ptxas's own report, without a GPU.

The library's CUDA sources are compiled with -Xptxas=-v through tools/ptxas-report.sh,
which keeps ptxas's report per object in the build's report folder. This reads those
reports, per kernel and architecture: its stack frame, its spill stores and loads, and its
registers. It fails when

* an expected object has no report, a report with kernels lacks one of the build's
  architectures, or no report has a kernel,
* a kernel has a stack frame above --max-stack bytes (default 1024: a by-value launch
  argument copied into local memory shows here as kilobytes per thread),
* a kernel spills more than --max-spill bytes (default 16), or
* a kernel uses more registers than lets --min-blocks blocks of --block-threads threads
  reside on one SM (65,536 registers per SM on sm_80, sm_90 and sm_100, allocated per warp
  in units of 256).

Every kernel of every object and architecture is printed with its figures, the failures
last. Exit status: 0 every kernel within the limits, 1 a kernel over one, 2 a missing or
unreadable report or a usage error.

With --no-trap PTX..., it checks instead that no kernel of those PTX files has a `trap`
instruction: nvcc compiles code it proves undefined to one (device code indexing a
host-only variable, say), which the CPU executor's tests cannot see.

Usage: tools/check-kernel-resources.py --reports DIR --arch 80 [--arch 90 ...]
           --expect step_kernels.cu.o [--expect ...]
       tools/check-kernel-resources.py --no-trap build/<preset>/.../step_kernels.ptx
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")
PROPS = re.compile(r"Function properties for (\S+?):?$")

REGISTERS_PER_SM = 65536
WARP = 32
REGISTER_UNIT = 256  # registers are allocated per warp in units of this many


def blocks_per_sm(registers: int, block_threads: int) -> int:
    """How many blocks of block_threads threads the register file holds at `registers`."""
    per_warp = -(-registers * WARP // REGISTER_UNIT) * REGISTER_UNIT
    warps = -(-block_threads // WARP)
    return REGISTERS_PER_SM // (per_warp * warps) if registers else 1 << 30


def kernels_of(report: str) -> list[dict]:
    """Each kernel ptxas reported: name, arch, stack, spills, registers."""
    # ptxas also reports the properties of the device functions it did not inline (after
    # "Function properties for <function>"): only the entry's own frame line is the kernel's.
    out: list[dict] = []
    cur = None
    props_of = None
    for line in report.splitlines():
        if m := ENTRY.search(line):
            cur = {"name": m.group(1), "arch": m.group(2), "stack": 0, "spill": 0, "regs": 0}
            out.append(cur)
        elif m := PROPS.search(line.strip()):
            props_of = m.group(1)
        elif cur is not None and props_of == cur["name"] and (m := FRAME.search(line)):
            cur["stack"], cur["spill"] = int(m.group(1)), int(m.group(2)) + int(m.group(3))
        elif cur is not None and (m := USED.search(line)):
            cur["regs"] = int(m.group(1))
    return out


def short_names(mangled: list[str]) -> dict[str, str]:
    """Readable kernel names: c++filt's, without namespaces and parameters (else as given)."""
    try:
        r = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True,
                           text=True, check=True)
        plain = r.stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return {m: m for m in mangled}
    out = {}
    for m, d in zip(mangled, plain):
        d = re.sub(r"\b[A-Za-z_]\w*::|\(anonymous namespace\)::", "", d)
        d = re.sub(r"^void ", "", d)
        out[m] = d.split("(")[0] if "(" in d else d
    return out


ENTRY_PTX = re.compile(r"^(?:\.visible\s+)?\.entry\s+(\S+?)\(", re.M)


def traps_of(ptx: str) -> dict[str, int]:
    """The `trap;` instructions of each kernel (.entry) and device function of a PTX file."""
    out: dict[str, int] = {}
    starts = [(m.start(), m.group(1)) for m in ENTRY_PTX.finditer(ptx)]
    starts += [(m.start(), m.group(1))
               for m in re.finditer(r"^(?:\.visible\s+|\.weak\s+)?\.func\s+(?:\([^)]*\)\s*)?(\S+?)\(",
                                    ptx, re.M)]
    starts.sort()
    for k, (at, name) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else len(ptx)
        n = len(re.findall(r"^\s*trap;", ptx[at:end], re.M))
        if n:
            out[name] = n
    return out


def check_traps(paths: list[str]) -> int:
    """--no-trap: fails when a kernel of the PTX files has a `trap;` (nvcc compiles code it
    proves undefined, e.g. device code reading a host-only variable, to one)."""
    bad = 0
    entries = 0
    for path in paths:
        try:
            ptx = Path(path).read_text(errors="replace")
        except OSError as e:
            print(f"check-kernel-resources: cannot read {path} ({e})", file=sys.stderr)
            return 2
        entries += len(ENTRY_PTX.findall(ptx))
        names = traps_of(ptx)
        short = short_names(list(names))
        for name, n in names.items():
            print(f"TRAP: {path}: {short[name]}: {n} trap instruction(s)")
            bad += 1
    if not entries:
        print("check-kernel-resources: no kernel in the PTX files", file=sys.stderr)
        return 2
    print(f"check-kernel-resources: {entries} kernels in {len(paths)} PTX file(s), "
          f"{bad} with a trap")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--no-trap", nargs="+", metavar="PTX",
                    help="check only that these PTX files' kernels have no trap instruction")
    ap.add_argument("--reports", help="the build's ptxas report folder")
    ap.add_argument("--arch", action="append", help="e.g. 90 (repeatable)")
    ap.add_argument("--expect", action="append",
                    help="an object whose report must be there, e.g. step_kernels.cu.o")
    ap.add_argument("--max-stack", type=int, default=1024)
    ap.add_argument("--max-spill", type=int, default=16)
    ap.add_argument("--block-threads", type=int, default=256)
    ap.add_argument("--min-blocks", type=int, default=2)
    args = ap.parse_args()
    if args.no_trap:
        return check_traps(args.no_trap)
    if not (args.reports and args.arch and args.expect):
        ap.error("--reports, --arch and --expect are required (or --no-trap PTX...)")

    archs = {"sm_" + a.split("-")[0] for a in args.arch}  # CMake's "90-real" form
    failures: list[str] = []
    seen = 0
    for obj in args.expect:
        path = Path(args.reports) / (obj + ".ptxas")
        try:
            ks = kernels_of(path.read_text(errors="replace"))
        except OSError as e:
            print(f"check-kernel-resources: no report for {obj} ({e}); build the library first",
                  file=sys.stderr)
            return 2
        missing = archs - {k["arch"] for k in ks}
        if ks and missing:  # a source without kernels (host code only) has an empty report
            print(f"check-kernel-resources: {path} has no kernel for {sorted(missing)}",
                  file=sys.stderr)
            return 2
        names = short_names([k["name"] for k in ks])
        for k in ks:
            seen += 1
            name = names[k["name"]]
            blocks = blocks_per_sm(k["regs"], args.block_threads)
            print(f"{k['arch']:7} stack {k['stack']:6} B  spill {k['spill']:5} B  "
                  f"regs {k['regs']:3} ({min(blocks, 99)} blocks/SM)  {obj}: {name}")
            why = []
            if k["stack"] > args.max_stack:
                why.append(f"stack frame {k['stack']} B > {args.max_stack} B")
            if k["spill"] > args.max_spill:
                why.append(f"spills {k['spill']} B > {args.max_spill} B")
            if blocks < args.min_blocks:
                why.append(f"{k['regs']} registers leave {blocks} blocks of "
                           f"{args.block_threads} threads per SM < {args.min_blocks}")
            if why:
                failures.append(f"{k['arch']} {obj}: {name}: " + "; ".join(why))
    if not seen:
        print("check-kernel-resources: no kernel in any report", file=sys.stderr)
        return 2
    for f in failures:
        print("OVER: " + f)
    print(f"check-kernel-resources: {seen} kernels, {len(failures)} over a limit "
          f"(stack <= {args.max_stack} B, spill <= {args.max_spill} B, >= {args.min_blocks} "
          f"blocks of {args.block_threads} threads per SM)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
