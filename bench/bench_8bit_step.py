"""opt.step() with 8-bit AdamW state against f32 state and the peers' 8-bit CPU AdamW, in
one run with the same threads (a benchmark, not a timed test).

Runs: stepcore.torch.AdamW (f32 state, formula "torch"), stepcore.torch.AdamW8bit (default
formula "torchao"), torchao.optim.AdamW8bit and bitsandbytes.optim.AdamW8bit when they can
be imported. Every run steps the same params (--params elements in tensors of --tensor
elements, a multiple of 256, so torchao quantizes every one) with the same gradients.

Validation first: three steps of stepcore's AdamW8bit must give torchao's params, codes and
scales bit for bit (when torchao is there). Then the runs are timed in alternating rounds
(--rounds), each round the median of --repeats steps; the fastest round of each run is
printed with ms per step, ns per parameter and its ratio to stepcore's AdamW8bit.

Usage: /opt/torchenv/py bench/bench_8bit_step.py [--params 4194304] [--rounds 3]
       (PYTHONPATH must reach the stepcore package: the build tree's python/ or an install)
"""

import argparse
import statistics
import time

import torch

import stepcore
import stepcore.torch as st


def make_params(n, tensor, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = [tensor] * (n // tensor) + ([n % tensor] if n % tensor else [])
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in sizes]


def set_grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3


def peers():
    """{name: constructor} of the importable runs."""
    runs = {"stepcore AdamW (f32 state)": st.AdamW, "stepcore AdamW8bit": st.AdamW8bit}
    try:
        from torchao.optim import AdamW8bit as TorchaoAdamW8bit
        runs["torchao AdamW8bit"] = TorchaoAdamW8bit
    except ImportError:
        pass
    try:
        import bitsandbytes as bnb
        runs["bitsandbytes AdamW8bit"] = bnb.optim.AdamW8bit
    except ImportError:
        pass
    return runs


def validate(n, tensor, runs):
    """Three steps: stepcore's AdamW8bit equals torchao's bit for bit."""
    if "torchao AdamW8bit" not in runs:
        print("validation: torchao not importable; stepcore AdamW8bit checked by the tests only")
        return
    mine, theirs = make_params(n, tensor), make_params(n, tensor)
    a = st.AdamW8bit(mine, lr=1e-3)
    b = runs["torchao AdamW8bit"](theirs, lr=1e-3)
    for s in range(3):
        set_grads(mine, s)
        set_grads(theirs, s)
        a.step()
        b.step()
    for x, y in zip(mine, theirs):
        assert torch.equal(x.detach().view(torch.int32), y.detach().view(torch.int32)), "params"
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(a.state[x][k], b.state[y][k].codes), k
            assert torch.equal(a.state[x][k + "_absmax"].view(torch.int32),
                               b.state[y][k].scale.view(torch.int32)), k
    print("validation: stepcore AdamW8bit == torchao AdamW8bit (params, codes, scales) "
          "after 3 steps")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=4 * 1024 * 1024)
    ap.add_argument("--tensor", type=int, default=256 * 1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip", default="", help="comma-separated run names to leave out")
    args = ap.parse_args()
    assert args.tensor % stepcore.Q8_BLOCK_SIZE == 0
    runs = {k: v for k, v in peers().items() if k not in args.skip.split(",")}
    print(f"{args.params} params in tensors of {args.tensor}; torch threads "
          f"{torch.get_num_threads()}; stepcore ISA {stepcore.supported_isas()[-1]}")
    validate(min(args.params, 8 * args.tensor), args.tensor, runs)
    opts = {}
    for name, cls in runs.items():
        params = make_params(args.params, args.tensor)
        opts[name] = (cls(params, lr=1e-3), params)
        set_grads(params, 0)
        opts[name][0].step()  # state created (torchao: compiled)
    best = {name: float("inf") for name in opts}
    for _ in range(args.rounds):
        for name, (opt, params) in opts.items():
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            best[name] = min(best[name], statistics.median(times))
    ref = best["stepcore AdamW8bit"]
    for name, t in best.items():
        print(f"{name:28s} {t * 1e3:9.2f} ms/step  {t * 1e9 / args.params:7.2f} ns/param  "
              f"{t / ref:7.2f}x stepcore AdamW8bit's time")


if __name__ == "__main__":
    main()
