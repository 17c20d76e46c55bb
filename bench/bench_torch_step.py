"""The full-offload optimizer step as a PyTorch user writes it, against the same step
through stepcore, in one run with the same threads (not a timed test: a benchmark).

torch:     4 bf16 micro-batch gradients accumulated into f32 (torch._foreach_copy_ /
           torch._foreach_add_), torch.nn.utils.clip_grad_norm_, torch.optim.AdamW(fused=True),
           a bf16 copy of every parameter.
stepcore:  Engine.accumulate (copy, then add), the exact norm (norm_partial + finalize),
           Engine.step("adamw", ...) reading the gradients with the clip coefficient and
           writing the bf16 copy in its own pass.

Validation first: stepcore's step, given torch's clip coefficient, must give torch's
parameters, moments and bf16 copies bit for bit. Then both pipelines are timed
(median of --repeats), their ratio printed, and the Python overhead of one engine call on
2,000 one-element params and of stepcore.torch.AdamW.step() on them (its cached rows: grads
kept, and new grads after zero_grad(set_to_none=True)), decomposed, beside torch's fused
AdamW step on the same params and its kernel call alone (fastest of --micro-repeats).

Usage: /opt/torchenv/py bench/bench_torch_step.py [--hidden 512] [--layers 16] [--repeats 5]
       (PYTHONPATH must reach the stepcore package: the build tree's python/ or an install)
"""

import argparse
import statistics
import time

import torch

import stepcore
import stepcore.torch


def tensor_list(hidden, layers, vocab):
    """A decoder-only transformer's parameter shapes (Qwen/Llama-like, untied head)."""
    inter, kv = 4 * hidden, hidden // 8
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden,), (hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                   (hidden,), (inter, hidden), (inter, hidden), (hidden, inter)]
    shapes += [(hidden,), (vocab, hidden)]
    return shapes


def make_state(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) * 0.02 for s in shapes]
    micro = [[(torch.randn(s, generator=g) * 1e-3).to(torch.bfloat16) for s in shapes]
             for _ in range(4)]
    return params, micro


def torch_step(params, opt, micro, accs, copies, max_norm):
    torch._foreach_copy_(accs, micro[0])
    for mb in micro[1:]:
        torch._foreach_add_(accs, mb)
    for p, a in zip(params, accs):
        p.grad = a
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()
    torch._foreach_copy_(copies, params)
    return norm


def stepcore_step(engine, params, state, micro, accs, copies, max_norm, lr, clip=None):
    engine.accumulate(accs, micro[0], copy=True)
    for mb in micro[1:]:
        engine.accumulate(accs, mb)
    norm, finite, _, needs_exact = stepcore.finalize(engine.norm_partial(accs))
    if needs_exact:
        norm, finite, _, _ = stepcore.finalize(engine.norm_partial(accs, exact=True))
    c = stepcore.clip_coefficient(norm, max_norm) if clip is None else clip
    m, v, s = state
    engine.step("adamw", params, [m, v], s, accs, copies,
                hyper=dict(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01), clip=c)
    return norm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--micro-repeats", type=int, default=1000)  # the 2,000-param overhead
    ap.add_argument("--max-norm", type=float, default=1e-4)  # small: the step clips
    args = ap.parse_args()
    threads = torch.get_num_threads()
    engine = stepcore.Engine(threads=threads)
    shapes = tensor_list(args.hidden, args.layers, args.vocab)
    numel = sum(torch.Size(s).numel() for s in shapes)
    lr = 1e-3

    # torch's pipeline.
    t_params, micro = make_state(shapes, 1)
    t_params = [p.requires_grad_() for p in t_params]
    opt = torch.optim.AdamW(t_params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            fused=True)
    t_accs = [torch.empty(s) for s in shapes]
    t_copies = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
    # stepcore's: the same start.
    s_params = [p.detach().clone() for p in t_params]
    s_state = ([torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes],
               [torch.zeros((), dtype=torch.float32) for _ in shapes])
    s_accs = [torch.empty(s) for s in shapes]
    s_copies = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]

    # Validation: one step each; stepcore given torch's clip coefficient.
    with torch.no_grad():
        t_norm = torch_step(t_params, opt, micro, t_accs, t_copies, args.max_norm)
    # torch's coefficient exactly as clip_grad_norm_ forms it: a Python float divided by the
    # f32 norm tensor (Tensor.__rtruediv__: reciprocal, then multiply), clamped to 1.
    coef = float(torch.clamp(args.max_norm / (t_norm + 1e-6), max=1.0))
    stepcore_step(engine, s_params, s_state, micro, s_accs, s_copies, args.max_norm, lr,
                  clip=coef)
    same = all(torch.equal(a.detach().view(torch.int32), b.view(torch.int32))
               for a, b in zip(t_params, s_params))
    same = same and all(torch.equal(opt.state[p]["exp_avg"].view(torch.int32), m.view(torch.int32))
                        for p, m in zip(t_params, s_state[0]))
    same = same and all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                        for a, b in zip(t_copies, s_copies))
    if not same:
        raise SystemExit("FAILED: stepcore's step with torch's clip coefficient differs from torch's")
    print(f"validated: with torch's clip coefficient ({coef:.6g}) stepcore's step equals torch's "
          f"bit for bit (params, exp_avg, bf16 copies)")

    def timed(fn):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    with torch.no_grad():
        t_s = timed(lambda: torch_step(t_params, opt, micro, t_accs, t_copies, args.max_norm))
    s_s = timed(lambda: stepcore_step(engine, s_params, s_state, micro, s_accs, s_copies,
                                      args.max_norm, lr))
    print(f"step of {numel / 1e6:.1f} M parameters ({len(shapes)} tensors), 4 bf16 micro-batches, "
          f"{threads} threads, ISA {engine.isa}:")
    print(f"  torch    {t_s * 1e3:8.1f} ms  (foreach copy/add, clip_grad_norm_, AdamW(fused=True), "
          f"bf16 copy)")
    print(f"  stepcore {s_s * 1e3:8.1f} ms  (accumulate, exact norm, AdamW with the bf16 copy)")
    print(f"  ratio torch / stepcore: {t_s / s_s:.2f}")

    # Python overhead on 2,000 one-element params: the kernels are negligible, so what is
    # timed is the binding and the Python layer (and each engine's per-tensor dispatch).
    n = 2000
    ps = [torch.zeros(1) for _ in range(n)]
    ms = [torch.zeros(1) for _ in range(n)]
    vs = [torch.zeros(1) for _ in range(n)]
    ss = [torch.zeros((), dtype=torch.float32) for _ in range(n)]
    gs = [torch.full((1,), 1e-3) for _ in range(n)]
    one = stepcore.Engine(threads=1)
    hyper = dict(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    call = timed(lambda: one.step("adamw", ps, [ms, vs], ss, gs, hyper=hyper))
    print(f"  one Engine.step call on {n} one-element AdamW params ({5 * n} tensor arguments): "
          f"{call * 1e3:.3f} ms (binding + validation + kernels)")
    scale_call = timed(lambda: one.scale_(gs, 1.0))
    print(f"  one Engine.scale_ call on {n} one-element tensors: {scale_call * 1e3:.3f} ms")

    # stepcore.torch.AdamW.step(): its cached rows, decomposed. Each term is the fastest of
    # --micro-repeats calls (the medians are printed beside): on a shared machine noise only
    # adds, and the overhead is a difference of two timings that medians taken at different
    # moments inflate.
    def fastest(fn, k=args.micro_repeats):
        times = sorted(fn() for _ in range(k))
        return times[0], times[len(times) // 2]

    def clocked(fn):
        def once():
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        return once

    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(n)]
    opt = stepcore.torch.AdamW(params, lr=lr, weight_decay=0.0, threads=1)
    for p in params:
        p.grad = torch.full((1,), 1e-3)
    opt.step()  # checks in full and caches the rows
    kept, kept_med = fastest(clocked(opt.step))

    def renewed():
        opt.zero_grad(set_to_none=True)
        for p in params:
            p.grad = torch.full((1,), 1e-3)
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    renewed()
    fresh, _ = fastest(renewed, max(args.micro_repeats // 10, 20))
    rows = opt._tables[0]
    group_params = opt.param_groups[0]["params"]
    name, hyper = opt._group_hyper(0, opt.param_groups[0])

    def engine_only():
        rows.rows.prepare(group_params)
        t0 = time.perf_counter()
        rows.rows.run(opt.engine, name, hyper)
        return time.perf_counter() - t0

    engine, engine_med = fastest(engine_only)
    prepare, _ = fastest(clocked(lambda: rows.rows.prepare(group_params)))
    bumps, _ = fastest(clocked(lambda: torch.autograd.graph.increment_version(rows.bump)))
    print(f"  stepcore.torch.AdamW.step() on {n} one-element params, fastest of "
          f"{args.micro_repeats}: {kept * 1e3:.3f} ms (grads kept), {fresh * 1e3:.3f} ms (new "
          f"grads after zero_grad(set_to_none=True)); of it the engine (2,000 kernels, run on "
          f"the rows) {engine * 1e3:.3f} ms, so the Python + binding overhead is "
          f"{(kept - engine) * 1e3:.3f} ms (target 0.5): re-reading the rows "
          f"{prepare * 1e3:.3f} ms, autograd version bumps {bumps * 1e3:.3f} ms; medians: step "
          f"{kept_med * 1e3:.3f} ms, engine {engine_med * 1e3:.3f} ms, their difference "
          f"{(kept_med - engine_med) * 1e3:.3f} ms")

    # torch's fused AdamW on the same params: its step and its kernel call alone.
    tps = [torch.nn.Parameter(torch.zeros(1)) for _ in range(n)]
    topt = torch.optim.AdamW(tps, lr=lr, weight_decay=0.0, fused=True)
    for p in tps:
        p.grad = torch.full((1,), 1e-3)
    topt.step()
    few = max(args.micro_repeats // 10, 20)
    t_kept, _ = fastest(clocked(topt.step), few)
    st = [topt.state[p] for p in tps]
    lists = ([p.detach() for p in tps], [p.grad for p in tps], [x["exp_avg"] for x in st],
             [x["exp_avg_sq"] for x in st], [], [x["step"] for x in st])
    t_kernel, _ = fastest(clocked(lambda: torch._fused_adamw_(
        *lists, lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
        maximize=False)), few)
    print(f"  torch.optim.AdamW(fused=True).step() on the same: {t_kept * 1e3:.3f} ms; of it "
          f"torch._fused_adamw_ on the lists {t_kernel * 1e3:.3f} ms, so its Python overhead is "
          f"{(t_kept - t_kernel) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
