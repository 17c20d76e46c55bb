"""Host bytes per parameter of stepcore.torch.GradientManager, as a user runs it: a bf16
model on the CPU (the host device), real backward hooks, measured as the process's resident
set over the model's own tensors and its bf16 gradients (not a timed test: a benchmark).

Each row runs in a fresh process (so that nothing one case allocates stays resident for
the next): the model (--layers Linear(--hidden, --hidden) layers, bf16), a tiny manager
of the same kind first (the library's code pages resident before the baseline), then the
manager under test through --steps steps of --micro micro-batches, and:

  constructed  resident growth once the manager is built (masters loaded)
  steady       after the steps (every gradient released)
  peak         the most resident during the steps (VmHWM, reset at each step's start and
               at its final finish_backward), less the model's bf16 gradients while they
               exist (backward; and a full-offload step of one micro-batch, which holds
               them until step())
  overlap      an overlapped step whose clip rolls every speculated chunk back: steady and
               peak, with the rollback space (the speculation budget) shown apart
  save, load   the peak of save_checkpoint and of load_checkpoint over the steady state

Validation first: after the steps, every parameter (the bf16 compute weights in the
model's storage) must equal, bit for bit, the same steps through offload="none" (the
device-resident manager on the host device: another code path; for 8-bit state, which
only full offload keeps, full offload on one engine thread), and the manager's own
ledger (report()["memory"]) must be within 3 % of the measured steady growth.

Usage: /opt/torchenv/py bench/bench_memory.py [--hidden 2048] [--layers 12] [--steps 2]
       [--optimizers adamw,lion,sign_sgd,sgd,adamw8bit] [--modes full,optimizer,none]
       [--quick]
       (PYTHONPATH must reach the stepcore package: the build tree's python/ or an install)
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def _optimizer_kwargs(name):
    return dict(hyper={"momentum": 0.9}) if name == "sgd" else {}


def _run_steps(m, model, x, steps, micro, grads, overlap=False, max_norm=1.0):
    """Runs the steps; returns the most resident at once over the model's bf16 gradients:
    while backward runs (every gradient alive) the resident set less `grads`; from the
    final finish_backward to the step's end less `grads` only where the step still holds
    them (a full-offload step of one micro-batch)."""
    peak = 0
    for _ in range(steps):
        _reset_peak()
        m.begin_step(1.0 / 8, overlap)
        for mb in range(micro):
            m.begin_backward(mb == micro - 1)
            model(x).float().pow(2).mean().backward()
            m.finish_backward()
        held = getattr(m._m, "gradients_read_by_step", False)
        peak = max(peak, _status("VmHWM") - grads)
        _reset_peak()
        m.clip_grad_norm_(max_norm)
        m.step()
        peak = max(peak, _status("VmHWM") - (grads if held else 0))
    return peak


def case(args):
    """One row, in this process: prints a JSON record."""
    import torch

    import stepcore.torch as st

    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(*[torch.nn.Linear(args.hidden, args.hidden, bias=False)
                                         for _ in range(args.layers)]).to(torch.bfloat16)
    model = make()
    n = sum(p.numel() for p in model.parameters())
    x = torch.randn(8, args.hidden, dtype=torch.bfloat16)
    kw = _optimizer_kwargs(args.optimizer)
    # The library's code and the engine's first use resident before the baseline.
    small = torch.nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    w = st.GradientManager(small, offload=args.mode, optimizer=args.optimizer, threads=args.threads,
                           **kw)
    _run_steps(w, small, torch.ones(2, 64, dtype=torch.bfloat16), 1, 2, 0)
    _run_steps(w, small, torch.ones(2, 64, dtype=torch.bfloat16), 1, 1, 0)
    w.close()
    del w
    model(x).float().pow(2).mean().backward()  # autograd's own first use
    for p in model.parameters():
        p.grad = None
    gc.collect()
    base = _status("VmRSS")
    grads = 2 * n  # the model's bf16 gradients while backward runs
    m = st.GradientManager(model, offload=args.mode, optimizer=args.optimizer,
                           threads=args.threads, speculation="always",
                           speculation_bytes=0 if not args.overlap else -1, **kw)
    rec = dict(mode=args.mode, optimizer=args.optimizer, micro=args.micro, overlap=args.overlap,
               params=n, constructed=(_status("VmRSS") - base) / n)
    peak = _run_steps(m, model, x, args.steps, args.micro, grads)
    rec["steady"] = (_status("VmRSS") - base) / n
    rec["peak"] = (peak - base) / n
    report = m.report()
    ledger = report.get("memory")
    if ledger is not None:
        rec["ledger"] = (ledger["host_bytes"] + ledger["device_bytes"]) / n
        rec["ledger_peak"] = (ledger["host_peak"] + ledger["device_peak"]) / n
        spec = ledger["kinds"].get("speculation", {}).get("bytes", 0)
        spec += ledger["kinds"].get("speculation@device", {}).get("bytes", 0)
    else:
        spec = None
    if args.overlap:  # one more step, clipped hard: every speculated chunk rolls back
        peak = _run_steps(m, model, x, 1, args.micro, grads, overlap=True, max_norm=1e-9)
        r = m.report()
        rec["rolled_back"] = r.get("chunks_rolled_back", 0)
        rec["overlap_steady"] = (_status("VmRSS") - base) / n
        rec["overlap_peak"] = (peak - base) / n
        if r.get("memory") is not None:
            k = r["memory"]["kinds"]
            spec = k.get("speculation", {}).get("bytes", 0) + k.get(
                "speculation@device", {}).get("bytes", 0)
    rec["speculation"] = None if spec is None else spec / n
    if args.checkpoint:
        path = os.path.join(tempfile.mkdtemp(prefix="stepcore-bench-memory-"), "ckpt")
        steady = _status("VmRSS")
        _reset_peak()
        m.save_checkpoint(path) if hasattr(m, "save_checkpoint") else m._m.save_checkpoint(path)
        rec["save"] = (_status("VmHWM") - steady) / n
        os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
        _reset_peak()
        m.load_checkpoint(path) if hasattr(m, "load_checkpoint") else m._m.load_checkpoint(path)
        rec["load"] = (_status("VmHWM") - steady) / n
        os.unlink(path)
    # The compute weights, for validation against offload="none" in the parent.
    rec["digest"] = _digest(model)
    m.close()
    print(json.dumps(rec))


def _digest(model):
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().view(-1).view(dtype=__import__("torch").int16).numpy().tobytes())
    return h.hexdigest()


def _spawn(args, **over):
    cmd = [sys.executable, __file__, "--case"]
    d = vars(args) | over
    for k in ("hidden", "layers", "steps", "threads", "mode", "optimizer", "micro"):
        cmd += [f"--{k}", str(d[k])]
    if d["overlap"]:
        cmd.append("--overlap")
    if d["checkpoint"]:
        cmd.append("--checkpoint")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")  # freed tensors leave the heap
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"case {over} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fmt(v):
    return "–" if v is None else f"{v:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--optimizers", default="adamw,lion,sign_sgd,sgd,adamw8bit")
    ap.add_argument("--modes", default="full,optimizer,none")
    ap.add_argument("--quick", action="store_true", help="small model (a smoke run)")
    ap.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="full", help=argparse.SUPPRESS)
    ap.add_argument("--optimizer", default="adamw", help=argparse.SUPPRESS)
    ap.add_argument("--micro", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        return case(args)
    if args.quick:
        args.hidden, args.layers = 256, 4
    print(f"# host bytes per parameter (resident set over the model and its bf16 grads), "
          f"{args.layers} x Linear({args.hidden}, {args.hidden}) bf16, {args.threads} threads")
    print("| mode | optimizer | micro-batches | constructed | steady | peak | ledger steady/peak "
          "| overlap steady / peak (of which rollback space) | save peak | load peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    failures = 0
    for mode in args.modes.split(","):
        for opt in args.optimizers.split(","):
            eight_bit = opt.endswith("8bit")  # block-wise 8-bit state: mode full only
            if mode != "full" and (opt != "adamw" or eight_bit):
                continue  # the device-resident modes once: their bytes are the device's
            for micro in (2, 1):
                r = _spawn(args, mode=mode, optimizer=opt, micro=micro, overlap=micro == 2,
                           checkpoint=micro == 2)
                # The reference: offload="none" (another code path), or for 8-bit state
                # (full offload only) one engine thread instead of several (another split).
                ref = _spawn(args, mode="full" if eight_bit else "none", optimizer=opt,
                             micro=micro, overlap=micro == 2, checkpoint=False,
                             threads=1 if eight_bit else args.threads)
                if r["digest"] != ref["digest"]:
                    print(f"VALIDATION FAILED: {mode} {opt} micro {micro}: the parameters differ "
                          "from the reference run")
                    failures += 1
                if r.get("ledger") is not None and abs(r["steady"] - r["ledger"]) > 0.03 * r["ledger"]:
                    print(f"note: {mode} {opt} micro {micro}: resident {r['steady']:.2f} vs ledger "
                          f"{r['ledger']:.2f} B/param (over 3 %)")
                spec = ""
                if micro == 2:
                    spec = (f"{_fmt(r.get('overlap_steady'))} / {_fmt(r.get('overlap_peak'))} "
                            f"({_fmt(r.get('speculation'))}; {r.get('rolled_back', 0)} rolled back)")
                print(f"| {mode} | {opt} | {micro} | {_fmt(r['constructed'])} | {_fmt(r['steady'])} "
                      f"| {_fmt(r['peak'])} | {_fmt(r.get('ledger'))}/{_fmt(r.get('ledger_peak'))} "
                      f"| {spec} | {_fmt(r.get('save'))} | {_fmt(r.get('load'))} |")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
