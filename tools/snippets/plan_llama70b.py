"""Prints docs/managers.md's predictions for Llama 3 70B: stepcore-plan's output for
tests/data/hf/llama3-70b.json on 8 ranks, 8 per node, mode full, 2 micro-batches, checked
against 480 GB of host memory per GPU and 80 GiB GPUs, with AdamW and then with AdamW's
8-bit state (adamw8bit), each command and its output in a block.

The executable is $STEPCORE_PLAN (the docs test sets it), else the first build's
build/*/apps/stepcore-plan; it runs from the repository root so the path it prints is
the one shown. tools/check-snippets.py compares the region with this output.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--hf-config", "tests/data/hf/llama3-70b.json", "--ranks", "8", "--ranks-per-node",
          "8", "--offload", "full"]
LIMITS = ["--micro-batches", "2", "--host-memory", "3840GB", "--gpu-memory", "80GiB"]
RUNS = [COMMON + ["--optimizer", "adamw"] + LIMITS, COMMON + ["--optimizer", "adamw8bit"] + LIMITS]


def executable() -> str:
    exe = os.environ.get("STEPCORE_PLAN")
    if exe:
        return exe
    for candidate in sorted(ROOT.glob("build/*/apps/stepcore-plan")):
        return str(candidate)
    sys.exit("plan_llama70b: no stepcore-plan (set STEPCORE_PLAN or build it)")


def main() -> None:
    for k, args in enumerate(RUNS):
        out = subprocess.run([executable(), *args], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout
        if k:
            print()
        print("```sh")
        print("stepcore-plan " + " ".join(args))
        print("```")
        print()
        print("```text")
        print(out, end="")
        print("```")


if __name__ == "__main__":
    main()
