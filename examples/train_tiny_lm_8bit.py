"""Trains examples/train_tiny_lm.py's tiny LM with f32 AdamW state and with 8-bit state.

The same seeded model, corpus, step loop (summed token losses scaled by 1 / the step's
loss tokens, `clip_grad_norm_`, warm-up + cosine lr, set as the same f32 value in every
run) runs with:

* `f32`: `stepcore.torch.AdamW` (formula "torch": torch's fused AdamW bit for bit);
* `8bit`: `stepcore.torch.AdamW8bit` (block-wise 8-bit moments for every param of at least
  4,096 elements, formula "torchao");
* `torchao`: `torchao.optim.AdamW8bit`, when torchao can be imported.

`--model llama` trains a Hugging Face `transformers.LlamaForCausalLM` instead (RMSNorm,
rotary positions, grouped-query attention, SwiGLU MLP, an untied head: `--dim`, `--layers`,
`--heads` size it, half as many key-value heads, the MLP 8/3 as wide rounded to 64),
initialised by transformers from `--seed`, on the same corpus and step loop.

It prints the loss per step of each run, whether the `8bit` and `torchao` runs gave the
same params after every step (they do when every param stepcore quantizes is a multiple of
256 elements, as here: torchao keeps f32 state for the others), the state bytes per
parameter of each run, and the final losses. `--csv PATH` writes the curves, `--svg PATH`
draws them (no plotting library needed).

Run: PYTHONPATH=build/<preset>/python /opt/torchenv/py examples/train_tiny_lm_8bit.py --steps 300
     [--model llama]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_tiny_lm as lm  # noqa: E402

RUNS = ("f32", "8bit", "torchao")


def make_optimizer(run: str, params, lr: float):
    """The optimizer of run `run` over `params` (None when torchao is missing)."""
    kw = dict(lr=lr, betas=lm.BETAS, eps=lm.EPS, weight_decay=lm.WEIGHT_DECAY)
    if run == "f32":
        import stepcore.torch as st
        return st.AdamW(params, **kw)
    if run == "8bit":
        import stepcore.torch as st
        return st.AdamW8bit(params, **kw)
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        return None
    return AdamW8bit(params, **kw)


def state_bytes(opt) -> int:
    """Bytes of the optimizer's state tensors (an 8-bit state: its codes and scales)."""
    total = 0
    for st in opt.state.values():
        for v in st.values():
            parts = [getattr(v, "codes", None), getattr(v, "scale", None)]
            for t in (parts if parts[0] is not None else [v]):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


def set_lr(opt, lr: float) -> None:
    """Sets every group's lr to f32(lr), the same number for every run: torchao keeps lr as
    an f32 tensor (a scheduler's arithmetic on it is f32), stepcore reads a Python float."""
    lr = float(torch.tensor(lr, dtype=torch.float32))
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


class HFCausalLM(torch.nn.Module):
    """A transformers causal LM as the step loop calls a model: token ids in, logits out
    (right padding needs no attention mask: a causal query never sees the later PADs)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


def build_llama(args) -> torch.nn.Module:
    """The Hugging Face Llama of `args`, initialised by transformers from args.seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim,
                         intermediate_size=(8 * args.dim // 3 + 63) // 64 * 64,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=max(1, args.heads // 2),
                         max_position_embeddings=args.context, tie_word_embeddings=False,
                         attn_implementation="eager")
    torch.manual_seed(args.seed)
    return HFCausalLM(LlamaForCausalLM(config))


def train(args, run: str, data):
    """Trains run `run`; returns (losses per step, params after each step, state bytes)
    or None when its optimizer is not available."""
    torch.manual_seed(args.seed)
    model = build_llama(args) if args.model == "llama" else lm.build_model(args)
    params = list(model.parameters())
    opt = make_optimizer(run, params, args.lr)
    if opt is None:
        return None
    factor = lm.make_schedule(args.warmup, args.steps)
    losses, snapshots = [], []
    for s, mbs in enumerate(data):
        set_lr(opt, args.lr * factor(s))
        tokens = lm.step_tokens(mbs)
        loss_sum = 0.0
        for mb in mbs:
            loss = lm.model_loss_sum(model, mb)
            loss.backward()
            loss_sum += float(loss.detach())
        grads = [p.grad for p in params if p.grad is not None]
        torch._foreach_mul_(grads, 1.0 / tokens)
        torch.nn.utils.clip_grad_norm_(params, args.max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss_sum / tokens)
        snapshots.append(torch.cat([lm.bits(p.detach()).reshape(-1) for p in params]))
    n = sum(p.numel() for p in params)
    return losses, snapshots, state_bytes(opt) / n


def write_svg(path: str, curves: dict[str, list[float]]) -> None:
    """Draws the loss curves (step on x, loss on y) as an SVG file."""
    w, h, m = 640, 360, 50
    values = [v for c in curves.values() for v in c]
    lo, hi = min(values), max(values)
    steps = max(len(c) for c in curves.values())
    colors = {"f32": "#1f77b4", "8bit": "#d62728", "torchao": "#2ca02c"}
    dashes = {"f32": "", "8bit": "", "torchao": "stroke-dasharray='6 4'"}

    def xy(i, v):
        x = m + (w - 2 * m) * i / max(1, steps - 1)
        y = h - m - (h - 2 * m) * (v - lo) / max(hi - lo, 1e-12)
        return f"{x:.1f},{y:.1f}"

    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' "
           "font-family='sans-serif' font-size='12'>",
           f"<rect width='{w}' height='{h}' fill='white'/>",
           f"<line x1='{m}' y1='{h - m}' x2='{w - m}' y2='{h - m}' stroke='black'/>",
           f"<line x1='{m}' y1='{m}' x2='{m}' y2='{h - m}' stroke='black'/>",
           f"<text x='{w / 2}' y='{h - 12}' text-anchor='middle'>step</text>",
           f"<text x='12' y='{m - 12}'>loss per token</text>",
           f"<text x='{m - 4}' y='{m + 4}' text-anchor='end'>{hi:.2f}</text>",
           f"<text x='{m - 4}' y='{h - m}' text-anchor='end'>{lo:.2f}</text>",
           f"<text x='{w - m}' y='{h - m + 16}' text-anchor='end'>{steps}</text>"]
    for k, (name, c) in enumerate(curves.items()):
        pts = " ".join(xy(i, v) for i, v in enumerate(c))
        out.append(f"<polyline fill='none' stroke='{colors.get(name, 'gray')}' "
                   f"stroke-width='1.5' {dashes.get(name, '')} points='{pts}'/>")
        out.append(f"<text x='{w - m - 150}' y='{m + 16 * k}' fill='{colors.get(name, 'gray')}'>"
                   f"{name}: final {c[-1]:.4f}</text>")
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def parse_args(argv=None):
    """The tiny LM's options (train_tiny_lm.add_model_arguments), plus --csv and --svg."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    lm.add_model_arguments(p)
    p.add_argument("--model", choices=("tiny", "llama"), default="tiny",
                   help="the tiny LM, or a Hugging Face LlamaForCausalLM (transformers)")
    p.add_argument("--csv", metavar="PATH")
    p.add_argument("--svg", metavar="PATH")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Trains every run; exit 0 when the 8-bit runs agree (or torchao is missing)."""
    args = parse_args(argv)
    lm.setup_determinism(args, args.torch_threads)
    data = lm.corpus(args)
    results = {run: r for run in RUNS if (r := train(args, run, data)) is not None}
    for s in range(args.steps):
        print(f"step {s:4d} " + "  ".join(f"{run} {r[0][s]:.4f}" for run, r in results.items()))
    for run, r in results.items():
        print(f"{run}: final loss {r[0][-1]:.4f}, optimizer state {r[2]:.2f} bytes per param")
    ok = True
    if "torchao" in results:
        same = all(torch.equal(a, b) for a, b in zip(results["8bit"][1], results["torchao"][1]))
        print(f"bitwise: stepcore AdamW8bit and torchao AdamW8bit params "
              f"{'identical' if same else 'NOT identical'} after every step")
        ok = same
    d = results["8bit"][0][-1] - results["f32"][0][-1]
    print(f"final loss, 8-bit minus f32 state: {d:+.4f}")
    curves = {run: r[0] for run, r in results.items()}
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("step," + ",".join(curves) + "\n")
            for s in range(args.steps):
                f.write(f"{s}," + ",".join(f"{c[s]:.6f}" for c in curves.values()) + "\n")
    if args.svg:
        write_svg(args.svg, curves)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
