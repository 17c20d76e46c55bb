#!/usr/bin/env python3
"""The device check's table of figures (tools/gpu-check.sh): reads what the phases left in
the log folder and prints one table, and writes it with the phases as summary.json.

    gpu_summary.py LOGDIR HAVE_GPU

Inputs (each optional): phases.tsv (name, status, seconds, note), bench-gpu.json
(stepcore-bench-gpu --json), nccl-step.json (stepcore-gpu-nccl-step --json on the GPU),
nccl-step-host.json (its --host run, without a GPU), ctest-results.txt ("NAME verdict"
per gpu test). A figure the device did not give reads "n/a (no device)", or "n/a (...)"
with the reason. Standard library only: any python3 on the machine runs it.
"""
import json
import os
import sys

NO_DEVICE = "n/a (no device)"

# The kernels' rows of stepcore-bench-gpu, by the start of their names.
KERNELS = [("scale+norm", "scale+norm"), ("norm only", "norm"), ("accumulate", "accumulate")]


def load_json(path):
    """The file's JSON, or None when it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_phases(logdir):
    phases = []
    try:
        with open(os.path.join(logdir, "phases.tsv"), encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 4:
                    phases.append({"phase": parts[0], "status": parts[1],
                                   "seconds": int(parts[2]) if parts[2].isdigit() else parts[2],
                                   "note": parts[3]})
    except OSError:
        pass
    return phases


def read_ctest(logdir):
    """{suite: {verdict: count}} from "Suite.Test verdict" lines."""
    suites = {}
    try:
        with open(os.path.join(logdir, "ctest-results.txt"), encoding="utf-8") as f:
            for line in f:
                name, _, verdict = line.strip().rpartition(" ")
                if not name:
                    continue
                suite = name.split(".", 1)[0]
                counts = suites.setdefault(suite, {})
                counts[verdict] = counts.get(verdict, 0) + 1
    except OSError:
        pass
    return suites


def figures(logdir, have_gpu):
    """The table's rows: (figure, value) pairs, in order."""
    rows = []
    bench = load_json(os.path.join(logdir, "bench-gpu.json")) if have_gpu else None
    for prefix, label in KERNELS:
        row = next((r for r in (bench or {}).get("rows", []) if r["name"].startswith(prefix)), None)
        rows.append((f"{label}: ratio to a device copy",
                     f"{row['ratio']:.3f} ({row['gbps']:.0f} GB/s)" if row else NO_DEVICE))
    # Every optimizer the benchmark timed (one row each, named from the optimizer table).
    optimizers = [r for r in (bench or {}).get("rows", []) if r.get("optimizer")]
    for row in optimizers:
        rows.append((f"{row['name'].split(' ')[0]}: ratio to a device copy",
                     f"{row['ratio']:.3f} ({row['gbps']:.0f} GB/s)"))
    if not optimizers:
        rows.append(("each optimizer: ratio to a device copy", NO_DEVICE))
    for prefix, label in (("adamw", "AdamW"), ("scale+norm", "scale+norm")):
        row = next((r for r in (bench or {}).get("rows", []) if r["name"].startswith(prefix)), None)
        tensors = f"{bench['tensors']} tensors" if bench and "tensors" in bench else "model list"
        rows.append((f"host cost per call: {label} ({tensors}, repeated)",
                     f"{row['host_us']:.1f} us" if row else NO_DEVICE))
    rows.append(("host cost per call: scale+norm (2,000 small tensors)",
                 f"{bench['host_us_small_call']:.1f} us" if bench else NO_DEVICE))

    device = load_json(os.path.join(logdir, "nccl-step.json")) if have_gpu else None
    host = load_json(os.path.join(logdir, "nccl-step-host.json"))
    for mode in ("none", "optimizer", "full"):
        def syncs(doc):
            runs = [r for r in (doc or {}).get("runs", []) if r["mode"] == mode]
            return ", ".join(f"{r['optimizer']} {'/'.join(map(str, r['host_syncs']))}"
                             for r in runs)
        got = syncs(device)
        if got:
            value = got
        else:
            value = NO_DEVICE + (f"; host device: {syncs(host)}" if syncs(host) else "")
        rows.append((f"host syncs per manager step, mode {mode} (counted)", value))

    suites = read_ctest(logdir)
    for suite in sorted(suites):
        c = suites[suite]
        ran = c.get("passed", 0) + c.get("failed", 0)
        if not have_gpu or ran == 0:
            value = NO_DEVICE + f" ({sum(c.values())} tests)"
        else:
            value = "bitwise: " + ", ".join(f"{n} {v}" for v, n in sorted(c.items()))
        rows.append((f"CPU == GPU, suite {suite}", value))
    if device:
        bad = [f"{r['mode']} {r['optimizer']}" for r in device.get("runs", []) if not r["bitwise"]]
        rows.append(("CPU == GPU, manager steps (stepcore-gpu-nccl-step)",
                     "bitwise: every run" if not bad else "DIFFER: " + ", ".join(bad)))
    else:
        rows.append(("CPU == GPU, manager steps (stepcore-gpu-nccl-step)", NO_DEVICE))

    norm = (device or {}).get("norm")
    rows.append(("NCCL norm vs a float all-reduce (step 1)",
                 f"float all-reduce {norm['float_allreduce_ulps']:+d} ulp, double reference "
                 f"{norm['double_reference_ulps']:+d} ulp from stepcore's" if norm else NO_DEVICE))
    return rows


def main(argv):
    if len(argv) != 3:
        print("usage: gpu_summary.py LOGDIR HAVE_GPU(0|1)", file=sys.stderr)
        return 2
    logdir, have_gpu = argv[1], argv[2] == "1"
    rows = figures(logdir, have_gpu)
    width = max(len(name) for name, _ in rows)
    print(f"{'figure':<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    summary = {"have_gpu": have_gpu, "phases": read_phases(logdir),
               "figures": [{"figure": n, "value": v} for n, v in rows]}
    with open(os.path.join(logdir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
