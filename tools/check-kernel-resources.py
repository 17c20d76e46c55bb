#!/usr/bin/env python3
"""Checks what the CUDA kernels cost each thread, from ptxas's own report, without a GPU.

Compiles each given .cu file for each architecture (nvcc -cubin -Xptxas -v, nothing
linked or kept) and reads, per kernel: its stack frame, its spill stores and loads, and
its registers. It fails when a kernel

* has a stack frame above --max-stack bytes (default 1024: a by-value launch argument
  copied into local memory shows here as kilobytes per thread),
* spills more than --max-spill bytes (default 16: the exact norm lane's 12 today), or
* uses more registers than lets --min-blocks blocks of --block-threads threads reside on
  one SM (65,536 registers per SM on sm_80, sm_90 and sm_100, allocated per warp in
  units of 256).

Every kernel of every file and architecture is printed with its figures, the failures
last. Exit status: 0 every kernel within the limits, 1 a kernel over one, 2 usage or a
compiler error.

Usage: tools/check-kernel-resources.py --nvcc NVCC --arch 80 [--arch 90 ...]
           [--flag=-I... ...] FILE.cu [FILE.cu ...]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvcc", required=True)
    ap.add_argument("--arch", action="append", required=True, help="e.g. 90 (repeatable)")
    ap.add_argument("--flag", action="append", default=[], help="a compiler flag (repeatable)")
    ap.add_argument("--max-stack", type=int, default=1024)
    ap.add_argument("--max-spill", type=int, default=16)
    ap.add_argument("--block-threads", type=int, default=256)
    ap.add_argument("--min-blocks", type=int, default=2)
    ap.add_argument("sources", nargs="+")
    args = ap.parse_args()

    failures: list[str] = []
    seen = 0
    for src in args.sources:
        for arch in args.arch:
            arch = arch.split("-")[0]  # CMake's "90-real" form
            cmd = [args.nvcc, "-cubin", f"-arch=sm_{arch}", "-Xptxas", "-v", "-o", "/dev/null",
                   *args.flag, src]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stdout + r.stderr, file=sys.stderr)
                print(f"check-kernel-resources: nvcc failed on {src} for sm_{arch}",
                      file=sys.stderr)
                return 2
            ks = kernels_of(r.stdout + r.stderr)
            if not ks:
                print(f"check-kernel-resources: no kernel reported for {src}, sm_{arch}",
                      file=sys.stderr)
                return 2
            for k in ks:
                seen += 1
                blocks = blocks_per_sm(k["regs"], args.block_threads)
                print(f"{k['arch']:7} stack {k['stack']:6} B  spill {k['spill']:5} B  "
                      f"regs {k['regs']:3} ({min(blocks, 99)} blocks/SM)  {k['name']}")
                why = []
                if k["stack"] > args.max_stack:
                    why.append(f"stack frame {k['stack']} B > {args.max_stack} B")
                if k["spill"] > args.max_spill:
                    why.append(f"spills {k['spill']} B > {args.max_spill} B")
                if blocks < args.min_blocks:
                    why.append(f"{k['regs']} registers leave {blocks} blocks of "
                               f"{args.block_threads} threads per SM < {args.min_blocks}")
                if why:
                    failures.append(f"{k['arch']} {k['name']}: " + "; ".join(why))
    for f in failures:
        print("OVER: " + f)
    print(f"check-kernel-resources: {seen} kernels, {len(failures)} over a limit "
          f"(stack <= {args.max_stack} B, spill <= {args.max_spill} B, >= {args.min_blocks} "
          f"blocks of {args.block_threads} threads per SM)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
