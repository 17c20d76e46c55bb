"""One optimizer step of stepcore's drop-ins against what users run today, in one run with
the same threads (not a timed test: a benchmark): torch's fused CPU optimizers
(torch.optim.AdamW/Adam/SGD/Adagrad with fused=True) and DeepSpeed's CPU ops
(DeepSpeedCPUAdam with adamw_mode True and False, DeepSpeedCPUAdagrad, DeepSpeedCPULion).

stepcore:  every optimizer stepcore.optimizers() lists (the C++ units' table), each through
           its stepcore.torch drop-in at the table's defaults with weight decay 0.01 (SGD:
           momentum 0.9); an optimizer without a drop-in in this build prints "not
           available" and its peers are still timed; one without a peer prints "no peer"
           and is timed alone.
peers:     which torch and DeepSpeed class matches which stepcore optimizer (PEERS below):
           the peers' facts, keyed by stepcore's names.
DeepSpeed: optional (tools/setup-deepspeed.sh installs it); its CPU ops are built at first
           use with DS_ACCELERATOR=cpu, which this script sets.

Validation first, for every optimizer: --validate-steps steps from identical params with
new gradients each step, over tensors of boundary sizes (1, 7-9, 31-33, 1023-1025) and a
small model's shapes. stepcore must equal torch's fused optimizer bit for bit (params and
every state tensor, the step counter included); DeepSpeed's kernels use their own formula
(Adam's moments as b*m + (1-b)*g, not torch's lerp; the powers of beta kept in f32 by
repeated products; eps added to sqrt(v) times 1/sqrt(1 - beta2^t)), so against them the
largest difference of an update, relative to the tensor's largest update, is printed and
must stay within --ds-tolerance, as must the state's (Lion: a sign taken of a value at
rounding level may flip, so there the share of elements beyond it is bounded instead).
Then per size: one untimed step of each optimizer (it creates the state; afterwards the
same checks run again on the timed data), then --repeats rounds that time one step of each
in turn (the order rotated every round), fastest and median printed, bytes moved per
element (the param, its gradient and each state array of its size) and GB/s (from the
fastest), and the ratios peer time / stepcore time (> 1: stepcore is faster). A markdown
summary closes the output.

Threads: OMP_NUM_THREADS and torch.set_num_threads (DeepSpeed's OpenMP loops run on
torch's runtime) and stepcore's threads all get --threads.

Usage: /opt/torchenv/py bench/bench_peers.py [--threads 2] [--sizes 1M,16M,64M,small]
       (PYTHONPATH must reach the stepcore package: the build tree's python/ or an install)
"""

import argparse
import inspect
import os
import platform
import statistics
import sys
import time

SIZES = ("1M", "16M", "64M", "small")

# The peers of each stepcore optimizer (stepcore.optimizers()'s names): torch.optim's fused
# class, and DeepSpeed's CPU op with its own keyword arguments, the names it gives
# stepcore's state slots where they differ, and whether its update is a sign (a sign taken
# of a value at rounding level may flip). An optimizer without an entry has no such peer.
PEERS = {
    "adamw": dict(torch="AdamW", deepspeed=("Adam", dict(adamw_mode=True), {}, False)),
    "adam": dict(torch="Adam", deepspeed=("Adam", dict(adamw_mode=False), {}, False)),
    "sgd": dict(torch="SGD"),
    "adagrad": dict(torch="Adagrad", deepspeed=("Adagrad", {}, dict(sum="exp_avg_sq"), False)),
    "lion": dict(deepspeed=("Lion", {}, {}, True)),
}
# The benchmark's hyper-parameters where they differ from the table's defaults (a field an
# optimizer does not have is left out): weight decay on, SGD with momentum.
OVERRIDES = dict(weight_decay=0.01, momentum=0.9)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default=",".join(SIZES),
                    help="comma-separated from " + ", ".join(SIZES))
    ap.add_argument("--optimizers", default=None,
                    help="comma-separated names from stepcore.optimizers() (default: all)")
    ap.add_argument("--repeats", type=int, default=0,
                    help="timed rounds per size (0: 41 up to 1M elements, then fewer)")
    ap.add_argument("--validate-steps", type=int, default=3)
    ap.add_argument("--ds-tolerance", type=float, default=1e-4,
                    help="largest allowed update and state difference against DeepSpeed, "
                         "relative to the tensor's largest")
    ap.add_argument("--isa", default=None, help="stepcore's ISA (default: the best)")
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args()
    for s in args.sizes.split(","):
        if s not in SIZES:
            ap.error(f"unknown size {s!r}")
    return args  # the optimizers are checked once stepcore is imported (after OMP_NUM_THREADS)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    # Before torch (and its OpenMP runtime, which DeepSpeed's ops share) is loaded.
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # torch's extension builder runs ninja from PATH: the venv's own.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]

import torch  # noqa: E402

import stepcore  # noqa: E402
import stepcore.torch  # noqa: E402


# ---- the tensors -------------------------------------------------------------------------


def model_shapes(hidden, layers, vocab):
    """A decoder-only transformer's parameter shapes (Qwen/Llama-like, untied head)."""
    inter, kv = 4 * hidden, hidden // 8
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden,), (hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                   (hidden,), (inter, hidden), (inter, hidden), (hidden, inter)]
    return shapes + [(hidden,), (vocab, hidden)]


def shapes_of(size):
    """The tensor list of a --sizes entry."""
    if size == "1M":
        return model_shapes(128, 2, 2048)  # 0.99 M elements, 23 tensors
    if size == "16M":
        return model_shapes(512, 2, 8192)  # 15.9 M, 23 tensors
    if size == "64M":
        return model_shapes(1024, 3, 8192)  # 61.6 M, 32 tensors
    # Many small tensors (norm weights, biases), odd sizes among them: 2,000 tensors.
    return [((1, 33, 256, 1024, 1025)[i % 5],) for i in range(2000)]


def validation_shapes():
    """Boundary sizes for the vector bodies' tails, then a small model's shapes."""
    return [(n,) for n in (1, 7, 8, 9, 31, 32, 33, 1023, 1024, 1025)] + model_shapes(64, 1, 512)


def make_params(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 0.02 for s in shapes]


def make_grads(shapes, seed):
    """Gradients spanning magnitudes: each tensor its own scale, 1e-6 to 1e-1."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) * 10.0 ** -(1 + i % 6) for i, s in enumerate(shapes)]


# ---- the optimizers ----------------------------------------------------------------------


def deepspeed_ops():
    """DeepSpeed's CPU optimizer classes and its version and SIMD width, or the reason why not."""
    if ARGS.no_deepspeed:
        return None, "skipped (--no-deepspeed)"
    try:
        import logging

        import deepspeed
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.lion import DeepSpeedCPULion
        from deepspeed.ops.op_builder import CPUAdamBuilder
        deepspeed.utils.logger.setLevel(logging.WARNING)  # no banner per optimizer
        simd = CPUAdamBuilder().simd_width().replace("-D__", "").replace("__", "").lower()
    except Exception as e:  # noqa: BLE001 - any failure means: no DeepSpeed peer
        return None, f"not available ({type(e).__name__}: {e}; tools/setup-deepspeed.sh)"
    return dict(Adam=DeepSpeedCPUAdam, Adagrad=DeepSpeedCPUAdagrad, Lion=DeepSpeedCPULion,
                version=deepspeed.__version__, simd=simd), None


def drop_in(name):
    """The stepcore.torch class that steps optimizer `name`, or None where there is none:
    stepcore.torch.optimizer_class where this build has it, else the drop-in whose default
    group the engine steps as `name`."""
    lookup = getattr(stepcore.torch, "optimizer_class", None)
    if lookup is not None:
        try:
            return lookup(name)
        except NotImplementedError:
            return None
    probe = [torch.nn.Parameter(torch.zeros(1))]
    for cls in vars(stepcore.torch).values():
        if (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
                and hasattr(cls, "_engine_name")):
            opt = cls(probe)
            if opt._engine_name(opt.param_groups[0]) == name:
                return cls
    return None


def hyper_of(name):
    """Optimizer `name`'s hyper-parameters here: the table's defaults, OVERRIDES applied."""
    hyper = dict(stepcore.optimizers()[name])
    hyper.update({k: v for k, v in OVERRIDES.items() if k in hyper})
    return hyper


def kwargs_for(cls, hyper):
    """The keyword arguments among `hyper` (the table's names) that the constructor of
    `cls` takes, beta1 and beta2 as its `betas` pair."""
    params = inspect.signature(cls).parameters
    kwargs = {k: v for k, v in hyper.items() if k in params}
    if "betas" in params and "beta1" in hyper:
        kwargs["betas"] = (hyper["beta1"], hyper["beta2"])
    return kwargs


def contenders(name, ds):
    """(label, kind, constructor over a param list, reason when there is none) of optimizer
    `name`: torch's fused one, DeepSpeed's and stepcore's drop-in, as far as each exists;
    the DeepSpeed names of stepcore's state slots; whether the update is a sign."""
    hyper = hyper_of(name)
    peers = PEERS.get(name, {})
    out = []
    if "torch" in peers:
        tcls = getattr(torch.optim, peers["torch"])
        out.append((f"torch.optim.{peers['torch']}(fused=True)", "torch",
                    lambda ps, kw=kwargs_for(tcls, hyper): tcls(ps, fused=True, **kw), None))
    ds_slots, sign = {}, False
    if "deepspeed" in peers:
        op, extra, ds_slots, sign = peers["deepspeed"]
        label = f"DeepSpeedCPU{op}" + "".join(f"({k}={v})" for k, v in extra.items())
        ctor = None
        if ds:
            ctor = lambda ps, cls=ds[op], kw=dict(kwargs_for(ds[op], hyper), **extra): \
                cls(ps, **kw)  # noqa: E731
        out.append((label, "deepspeed", ctor, None if ctor else "DeepSpeed not available"))
    sc = drop_in(name)
    ctor = None
    if sc is not None:
        ctor = lambda ps, kw=kwargs_for(sc, hyper): \
            sc(ps, threads=ARGS.threads, isa=ARGS.isa, **kw)  # noqa: E731
    out.append((f"stepcore.torch.{sc.__name__}" if sc else f"stepcore {name}", "stepcore", ctor,
                None if sc else "no drop-in in stepcore.torch in this build"))
    return out, ds_slots, sign


def bytes_per_element(runner):
    """Bytes one step moves per element: the param read and written, its gradient read,
    each state array of the param's size read and written (counted on the largest param;
    the per-tensor step counters are negligible)."""
    p = max(runner.params, key=lambda t: t.numel())
    return 4 * (3 + 2 * len(state_keys(runner, p)))


class Runner:
    """One optimizer over its own copy of the params and gradients."""

    def __init__(self, label, kind, ctor, params, grads):
        self.label, self.kind = label, kind
        self.params = [torch.nn.Parameter(p.clone()) for p in params]
        for p, g in zip(self.params, grads):
            p.grad = g.clone()
        self.opt = ctor(self.params)
        self.times = []

    def set_grads(self, grads):
        for p, g in zip(self.params, grads):
            p.grad.copy_(g)

    def step(self):
        t0 = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - t0

    def state(self, p, key):
        st = self.opt.state[p]
        return st.get(key) if key is not None else None


# ---- the checks --------------------------------------------------------------------------


def bits(t):
    """A tensor's bits (f32 as int32, so that -0 != +0 and NaNs compare by payload)."""
    t = t.detach().reshape(-1)
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def same_bits(a, b):
    """None if stepcore's runner `a` equals torch's `b` bit for bit (params and every tensor
    of the state that both keep), else what differs."""
    for i, (pa, pb) in enumerate(zip(a.params, b.params)):
        if not torch.equal(bits(pa), bits(pb)):
            return f"param {i} ({tuple(pa.shape)})"
        sa, sb = a.opt.state[pa], b.opt.state[pb]
        for key in sorted(set(sa) & set(sb)):
            x, y = sa[key], sb[key]
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                if x.dtype != y.dtype or not torch.equal(bits(x), bits(y)):
                    return f"state[{key!r}] of param {i} ({tuple(pa.shape)})"
            elif x != y:
                return f"state[{key!r}] of param {i}: {x!r} != {y!r}"
    return None


def state_keys(runner, p):
    """The keys of the state arrays `runner` keeps beside param `p` (its shape), in order."""
    return [k for k, v in runner.opt.state[p].items()
            if isinstance(v, torch.Tensor) and v.shape == p.shape]


def ds_difference(ref, ds, start, slots, tol):
    """Against DeepSpeed (`slots`: its names of the state arrays, where they differ): the largest |update difference| / the tensor's largest |update|,
    the largest state difference / the tensor's largest state value, and the fraction of
    elements whose update differs by more than `tol` of the tensor's largest. (A param's
    own relative difference says little: params near 0 inflate it.)"""
    upd = state = 0.0
    off = total = 0
    for i, (pr, pd, p0) in enumerate(zip(ref.params, ds.params, start)):
        if pr.numel() == 0:
            continue
        dr, dd = pr.detach() - p0, pd.detach() - p0
        scale = dd.abs().max().item()
        diff = (dr - dd).abs()
        if scale > 0:
            upd = max(upd, diff.max().item() / scale)
            off += int((diff > tol * scale).sum())
        total += pr.numel()
        for rk in state_keys(ref, pr):
            x, y = ref.state(pr, rk), ds.state(pd, slots.get(rk, rk))
            if not isinstance(y, torch.Tensor) or y.shape != x.shape:
                continue
            s = y.abs().max().item()
            if s > 0:
                state = max(state, (x - y).abs().max().item() / s)
    return upd, state, off / max(total, 1)


def check(name, runners, start, slots, sign, where, fail):
    """The checks of one optimizer after its steps (validation or the timed data's first):
    stepcore == torch bit for bit; DeepSpeed within --ds-tolerance (`slots`: its names of
    the state arrays; `sign`: the update is a sign). Prints one line each."""
    by = {r.kind: r for r in runners}
    if "stepcore" in by and "torch" in by:
        bad = same_bits(by["stepcore"], by["torch"])
        if bad:
            fail.append(f"{name} ({where}): stepcore differs from {by['torch'].label} in {bad}")
        print(f"    {name}: stepcore vs {by['torch'].label}: "
              f"{'DIFFERS in ' + bad if bad else 'equal bit for bit (params, state)'}")
    ref = by.get("stepcore") or by.get("torch")
    if "deepspeed" in by and ref is not None:
        tol = ARGS.ds_tolerance
        upd, state, off = ds_difference(ref, by["deepspeed"], start, slots, tol)
        ok = upd <= tol and state <= tol
        if sign:
            # sign(c) of c at rounding level can differ between two formulas: allow a few.
            ok = off <= 1e-5 and state <= tol
        if not ok:
            fail.append(f"{name} ({where}): DeepSpeed differs beyond the tolerance {tol:g}")
        print(f"    {name}: {ref.kind} vs {by['deepspeed'].label}: largest update difference "
              f"{upd:.2e} of the tensor's largest update, state {state:.2e}, elements beyond "
              f"{tol:g}: {off:.1e}"
              f"{'' if ok else '  BEYOND TOLERANCE'}")


# ---- the run -----------------------------------------------------------------------------


def machine_lines(ds, ds_reason, sc_isa):
    model = "unknown"
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    env_cap = os.environ.get("ATEN_CPU_CAPABILITY", "unset")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    return [
        f"machine: {model}, {os.cpu_count()} logical CPUs, {platform.machine()}, best x86 ISA "
        f"{isa}, load average {load}",
        f"threads: {ARGS.threads} (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
        f"torch.get_num_threads()={torch.get_num_threads()}, stepcore threads={ARGS.threads})",
        f"torch {torch.__version__}: CPU capability {torch.backends.cpu.get_cpu_capability()} "
        f"(ATEN_CPU_CAPABILITY={env_cap})",
        f"stepcore {stepcore.__version__}: ISA {sc_isa} (supported: "
        f"{', '.join(stepcore.supported_isas())})",
        "DeepSpeed " + (f"{ds['version']}: CPU ops built with {ds['simd']} "
                        f"(DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')})"
                        if ds else ds_reason),
    ]


def main():
    torch.set_num_threads(ARGS.threads)
    ds, ds_reason = deepspeed_ops()
    sc_isa = stepcore.Engine(isa=ARGS.isa, threads=ARGS.threads).isa
    for line in machine_lines(ds, ds_reason, sc_isa):
        print(line)
    table = stepcore.optimizers()
    names = ARGS.optimizers.split(",") if ARGS.optimizers else list(table)
    for name in names:
        if name not in table:
            raise SystemExit(f"unknown optimizer {name!r}: stepcore.optimizers() lists "
                             + ", ".join(table))
    for name in names:
        if not PEERS.get(name):
            print(f"{name}: no peer (neither torch.optim's fused optimizers nor DeepSpeed's CPU "
                  "ops have it): stepcore timed alone")
    fail = []

    # Validation: several steps, new gradients each, boundary sizes and a small model.
    shapes = validation_shapes()
    start = make_params(shapes, 1)
    print(f"validation: {ARGS.validate_steps} steps, {len(shapes)} tensors "
          f"({sum(torch.Size(s).numel() for s in shapes)} elements), new gradients each step")
    for name in names:
        cs, slots, sign = contenders(name, ds)
        runners = [Runner(label, kind, ctor, start, make_grads(shapes, 2))
                   for label, kind, ctor, _ in cs if ctor is not None]
        for k in range(ARGS.validate_steps):
            grads = make_grads(shapes, 2 + k)
            for r in runners:
                r.set_grads(grads)
                r.step()
        for label, _, ctor, why in cs:
            if ctor is None:
                print(f"    {name}: {label}: {why}")
        check(name, runners, start, slots, sign, "validation", fail)
    if fail:
        raise SystemExit("FAILED:\n  " + "\n  ".join(fail))

    rows = []
    for size in ARGS.sizes.split(","):
        shapes = shapes_of(size)
        numel = sum(torch.Size(s).numel() for s in shapes)
        repeats = ARGS.repeats or max(7, min(41, int(4e7 // numel)))
        params, grads = make_params(shapes, 3), make_grads(shapes, 4)
        print(f"\nsize {size}: {numel / 1e6:.2f} M elements in {len(shapes)} tensors, "
              f"{repeats} rounds, one step each per round")
        for name in names:
            cs, slots, sign = contenders(name, ds)
            runners = [Runner(label, kind, ctor, params, grads)
                       for label, kind, ctor, _ in cs if ctor is not None]
            if not runners:
                print(f"  {name:8s} nothing to time (no drop-in and no peer)")
                continue
            for r in runners:  # untimed: creates the state; then the same checks
                r.step()
            check(name, runners, params, slots, sign, f"size {size}, first step", fail)
            for k in range(repeats):
                order = runners[k % len(runners):] + runners[:k % len(runners)]
                for r in order:
                    r.times.append(r.step())
            by = {r.kind: r for r in runners}
            sc = by.get("stepcore")
            moved = bytes_per_element(runners[0]) if runners else 0
            for label, kind, ctor, why in cs:
                if ctor is None:
                    print(f"  {name:8s} {label:44s} {why}")
                    rows.append((size, numel, name, label, None, None, None, None, None))
                    continue
                r = by[kind]
                best, med = min(r.times), statistics.median(r.times)
                gbs = moved * numel / best / 1e9
                ratio = (best / min(sc.times), med / statistics.median(sc.times)) \
                    if sc is not None and kind != "stepcore" else None
                rows.append((size, numel, name, label, best, med, gbs, ratio, kind))
                say = (f"  stepcore speed-up {ratio[0]:.2f} (fastest) / {ratio[1]:.2f} (median)"
                       if ratio else "")
                print(f"  {name:8s} {label:44s} {best * 1e3:8.2f} ms fastest {med * 1e3:8.2f} "
                      f"ms median {moved:2d} B/elem {gbs:6.1f} GB/s{say}")
            del runners
        del params, grads

    print("\nspeed-up = peer time / stepcore time for the same step (> 1: stepcore faster)")
    print(f"load average at the end: {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("\n| size | optimizer | implementation | fastest ms | median ms | GB/s (fastest) | "
          "stepcore speed-up (fastest / median) |")
    print("|---|---|---|---|---|---|---|")
    for size, numel, name, label, best, med, gbs, ratio, _ in rows:
        what = f"{size} ({numel / 1e6:.2f} M)"
        if best is None:
            print(f"| {what} | {name} | {label} | not available | | | |")
            continue
        r = f"**{ratio[0]:.2f}** / {ratio[1]:.2f}" if ratio else ""
        print(f"| {what} | {name} | {label} | {best * 1e3:.2f} | {med * 1e3:.2f} | {gbs:.1f} "
              f"| {r} |")
    if fail:
        raise SystemExit("FAILED:\n  " + "\n  ".join(fail))


if __name__ == "__main__":
    main()
