"""How far the peers' CPU AdamW8bit steps land from stepcore's, and where they move
coordinates whose gradient is always zero (a comparison, not a test).

Runs --steps steps of AdamW (no weight decay, lr --lr) on one tensor of --numel elements
whose every fifth coordinate always has a zero gradient, from the same start and with the
same gradients, through: stepcore.torch.AdamW (f32 state, torch's fused AdamW bits),
stepcore.torch.AdamW8bit with formula "torch" (the nearest code) and "torchao",
bitsandbytes.optim.AdamW8bit and torchao.optim.AdamW8bit (each when importable).

Prints, for each 8-bit run against stepcore's AdamW8bit (formula "torch"), the largest
relative difference of the params after a step (|a - b| / |b| over the coordinates where
b != 0), at a few steps and the largest over the run; then for every run the largest
distance a zero-gradient coordinate moved from its start (stepcore: exactly 0, the
quantizer finds the code of zero).

Usage: /opt/torchenv/py bench/compare_8bit_peers.py [--steps 200] [--numel 1048576]
"""

import argparse

import torch

import stepcore.torch as st


def runs():
    out = {"stepcore AdamW (f32)": lambda p, lr: st.AdamW(p, lr=lr, weight_decay=0.0),
           "stepcore AdamW8bit torch": lambda p, lr: st.AdamW8bit(p, lr=lr, weight_decay=0.0,
                                                                  formula="torch"),
           "stepcore AdamW8bit torchao": lambda p, lr: st.AdamW8bit(p, lr=lr, weight_decay=0.0)}
    try:
        import bitsandbytes as bnb
        out["bitsandbytes AdamW8bit"] = lambda p, lr: bnb.optim.AdamW8bit(p, lr=lr,
                                                                           weight_decay=0.0)
    except ImportError:
        pass
    try:
        from torchao.optim import AdamW8bit
        out["torchao AdamW8bit"] = lambda p, lr: AdamW8bit(p, lr=lr, weight_decay=0.0)
    except ImportError:
        pass
    return out


def one_step_from_the_same_state(args, start, zero):
    """Each step of stepcore's AdamW8bit (formula "torch") against bitsandbytes' AdamW8bit
    started from the same params and 8-bit state (the same map and blocks: its state1,
    absmax1, state2, absmax2 set to stepcore's codes and maxima): the largest difference
    of the new params relative to the largest update, and the share of codes that differ."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        print("bitsandbytes is not importable: no one-step comparison")
        return
    mine = torch.nn.Parameter(start.clone())
    theirs = torch.nn.Parameter(start.clone())
    a = st.AdamW8bit([mine], lr=args.lr, weight_decay=0.0, formula="torch")
    b = bnb.optim.AdamW8bit([theirs], lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    worst, worst_codes = (0.0, 0), (0.0, 0)
    for s in range(args.steps):
        grad = torch.randn(args.numel, generator=g) * 1e-2
        grad[zero] = 0.0
        before = mine.detach().clone()
        mine.grad = grad.clone()
        theirs.grad = grad.clone()
        if s > 0:  # bitsandbytes from stepcore's state (its first step creates its own)
            with torch.no_grad():
                theirs.copy_(before)
            sa, sb = a.state[mine], b.state[theirs]
            sb["state1"].copy_(sa["exp_avg"])
            sb["absmax1"].copy_(sa["exp_avg_absmax"])
            sb["state2"].copy_(sa["exp_avg_sq"])
            sb["absmax2"].copy_(sa["exp_avg_sq_absmax"])
            sb["step"] = int(sa["step"])
        a.step()
        b.step()
        update = float((mine.detach() - before).abs().max())
        rel = float((mine.detach() - theirs.detach()).abs().max()) / update
        codes = float((a.state[mine]["exp_avg"] != b.state[theirs]["state1"]).float().mean())
        worst = max(worst, (rel, s + 1))
        worst_codes = max(worst_codes, (codes, s + 1))
    print(f"one step from the same state, bitsandbytes vs stepcore AdamW8bit (formula torch), "
          f"{args.steps} steps: largest param difference {worst[0]:.3e} of the largest update "
          f"(step {worst[1]}); exp_avg codes differing: at most {worst_codes[0]:.2%} "
          f"(step {worst_codes[1]})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--numel", type=int, default=1 << 20)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    start = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)) * 0.1
    zero = torch.zeros(args.numel, dtype=torch.bool)
    zero[::5] = True
    made = {name: make for name, make in runs().items()}
    params = {name: torch.nn.Parameter(start.clone()) for name in made}
    opts = {name: made[name]([params[name]], args.lr) for name in made}
    base = "stepcore AdamW8bit torch"
    worst = {name: (0.0, -1) for name in made if name != base}
    show = {0, 9, 99, args.steps - 1}
    g = torch.Generator().manual_seed(1)
    for s in range(args.steps):
        grad = torch.randn(args.numel, generator=g) * 1e-2
        grad[zero] = 0.0
        for name, p in params.items():
            p.grad = grad.clone()
            opts[name].step()
        b = params[base].detach()
        nz = b != 0
        for name in worst:
            a = params[name].detach()
            rel = float(((a - b).abs()[nz] / b.abs()[nz]).max())
            if rel > worst[name][0]:
                worst[name] = (rel, s)
            if s in show:
                print(f"step {s + 1:4d}  {name:28s} largest relative difference to {base}: "
                      f"{rel:.3e}")
    one_step_from_the_same_state(args, start, zero)
    for name, (rel, s) in worst.items():
        print(f"{name:28s} largest over {args.steps} steps: {rel:.3e} (step {s + 1})")
    for name, p in params.items():
        drift = float((p.detach()[zero] - start[zero]).abs().max())
        moved = int((p.detach()[zero] != start[zero]).sum())
        print(f"{name:28s} zero-gradient coordinates: {moved} of {int(zero.sum())} moved, "
              f"largest distance {drift:.3e}")


if __name__ == "__main__":
    main()
