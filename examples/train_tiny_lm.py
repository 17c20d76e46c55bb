"""Trains a tiny causal transformer LM on CPU with plain PyTorch and with stepcore.

The same seeded model, synthetic corpus (examples/tiny_corpus.py) and step loop run
several ways:

* `run_torch`: plain PyTorch: f32 params, gradients accumulated by autograd over uneven
  micro-batches (each loss a sum of token losses), multiplied by 1 / (the step's loss
  tokens, counted before the first forward), `clip_grad_norm_`, fused AdamW and a
  warm-up + cosine LambdaLR schedule. Runs with nothing but torch.
* `run_stepcore`: the same loop driven by `stepcore.torch.GradientManager` in each offload
  mode ("none", "optimizer", "full"), with and without optimizer-in-backward (overlap:
  each chunk is stepped speculatively during the final backward, then `clip_grad_norm_`
  commits it or rolls it back and steps it again with the clip coefficient).

With `--record DIR` every run records its tensors after each step with stepcore.diff
(docs/python.md, "Differential testing") into DIR/<run tag>/ (`torch`, `stepcore-none`,
`stepcore-full-overlap`, ...): the stepcore runs through the manager's `recorder=` hook,
the baseline with explicit `record` calls of the same names (the norm and clip
coefficient at point "clip"; exp_avg, exp_avg_sq, step, master and param of every
parameter at point "after_step"), so `python -m stepcore.diff DIR/torch DIR/stepcore-none`
says where they first diverge.

`main()` prints loss, gradient norm and lr per step for every run, then `bitwise:` lines
saying whether the stepcore modes gave the same bits (params, exp_avg, exp_avg_sq, step
and norm after every step), without and with overlap, and whether each mode's overlapped
run gave its non-overlapped run's bits at every step (with the run's speculation counts:
chunks speculated, committed, rolled back), and a line comparing stepcore with the
baseline. With
`--processes 2` the model is sharded with FSDP2 over two gloo processes that each run every
batch, and rank 0 compares every mode with the 1-process run (rank 0 prints). When
stepcore.torch.GradientManager cannot be imported only the baseline runs (exit 0).

Run: PYTHONPATH=build/<preset>/python /opt/torchenv/py examples/train_tiny_lm.py
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import socket
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_corpus import PAD, Batch, make_steps  # noqa: E402

MODES = ("none", "optimizer", "full")
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1


# ---- model ---------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer block: x + attn(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, dim: int, heads: int):
        """Creates the block's layers (uninitialised; TinyLM.reset_parameters sets them)."""
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns the block applied to x [batch, time, dim] with causal self-attention."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """A GPT-style causal LM: token + learned position embeddings, blocks, final LN, tied head.

    The output head reuses the token embedding (weight tying), so that one parameter gets
    gradient from two uses in each backward; right padding needs no attention mask since a
    causal query never sees the later PAD positions.
    """

    def __init__(self, vocab: int, context: int, dim: int, layers: int, heads: int, seed: int):
        """Creates the model and initialises it from `seed` (independent of the global RNG)."""
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.context = context
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Normal(0, 0.02) weights (residual outputs 0.02/sqrt(2*layers)), zero biases, unit LNs."""
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * len(self.blocks))
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                std = residual_std if name.endswith((".proj", ".out")) else 0.02
                m.weight.normal_(0.0, std, generator=gen)
                m.bias.zero_()
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, 0.02, generator=gen)
            elif isinstance(m, nn.LayerNorm):
                m.weight.fill_(1.0)
                m.bias.zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Returns logits [batch, time, vocab] for token ids [batch, time]."""
        t = ids.shape[1]
        if t > self.context:
            raise ValueError(f"sequence of {t} tokens exceeds the context {self.context}")
        x = self.tok(ids) + self.pos.weight[:t]
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok.weight)


def build_model(args) -> TinyLM:
    """Returns the seeded model of `args`."""
    return TinyLM(args.vocab, args.context, args.dim, args.layers, args.heads, args.seed)


def model_loss_sum(model: nn.Module, mb: Batch) -> torch.Tensor:
    """Returns the sum (not the mean) of the token cross-entropies of `mb`, PAD ignored."""
    logits = model(mb.inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb.targets.reshape(-1),
                           ignore_index=PAD, reduction="sum")


def make_schedule(warmup: int, total: int, floor: float = 0.1):
    """Returns the LambdaLR factor: linear warm-up to 1, then cosine down to `floor`."""
    def factor(step: int) -> float:
        """The lr multiplier for scheduler step `step` (0-based)."""
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


# ---- bookkeeping ---------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """Returns the bit pattern of an f32 tensor as int32 (other dtypes: a byte view); a
    DTensor's whole tensor (a collective: every rank calls it)."""
    t = t.detach()
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    t = t.contiguous().reshape(-1)
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def digest(tensors) -> str:
    """Returns a hash of the bits of `tensors`, in order."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        h.update(bits(t).numpy().tobytes())
    return h.hexdigest()


def state_digests(params: list[torch.Tensor], state_dict: dict) -> dict[str, str]:
    """Returns hashes of the params and of each torch-layout AdamW state field, by index."""
    state = state_dict["state"]
    out = {"params": digest(params)}
    for key in ("exp_avg", "exp_avg_sq", "step"):
        out[key] = digest(state[i][key] for i in range(len(params)))
    return out


def step_tokens(mbs: list[Batch]) -> int:
    """Returns the loss tokens of a step (all micro-batches, all ranks): its gradient scale's inverse."""
    return sum(mb.tokens for mb in mbs)


def local_share(mbs: list[Batch], rank: int, world: int) -> list[Batch]:
    """Returns this rank's rows of each micro-batch (data parallel; all rows when world == 1)."""
    return mbs if world == 1 else [mb.rows(rank, world) for mb in mbs]


def all_reduce_sum(x: float, world: int) -> float:
    """Returns the sum of `x` over the ranks (x itself when world == 1)."""
    if world == 1:
        return x
    import torch.distributed as dist
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def print_step(tag: str, s: int, rec: dict, show: bool) -> None:
    """Prints one step's line: step, loss per token, grad norm (before clipping), lr."""
    if not show:
        return
    print(f"[{tag}] step {s + 1:3d}  loss {rec['loss']:.5f}  norm {rec['norm']:.6f}  "
          f"lr {rec['lr']:.3e}", flush=True)


# ---- the two trainers ----------------------------------------------------------------


def make_recorder(args, tag: str, *, rank=None, extra=None):
    """Returns a stepcore.diff.Recorder into args.record/<tag>/ (None without --record)."""
    if not getattr(args, "record", None):
        return None
    from stepcore.diff import Recorder

    meta = {"run_tag": tag, "example": "train_tiny_lm", "steps": args.steps,
            "micro_batches": args.micro_batches, "seed": args.seed, "max_norm": args.max_norm,
            "lr": args.lr, "model": f"vocab {args.vocab} context {args.context} dim "
                                   f"{args.dim} layers {args.layers} heads {args.heads}"}
    meta.update(extra or {})
    return Recorder(os.path.join(args.record, tag), meta, rank=rank, overwrite=True)


def record_torch_step(rec, named, opt, norm, max_norm: float) -> None:
    """Records a baseline step under the names the manager's hook uses, then ends the step."""
    # norm and clip coefficient at "clip", then exp_avg, exp_avg_sq, step, master (the f32
    # param itself) and param of every parameter at "after_step".
    rec.record("clip", "norm", norm.detach().float().reshape(()))
    coef = torch.clamp(max_norm / (norm.detach().float() + 1e-6), max=1.0)  # torch's formula
    rec.record("clip", "clip_coefficient", coef.reshape(()))
    for kind in ("exp_avg", "exp_avg_sq", "step"):
        for name, p in named:
            rec.record("after_step", f"{kind}/{name}", opt.state[p][kind])
    for kind in ("master", "param"):
        for name, p in named:
            rec.record("after_step", f"{kind}/{name}", p)
    rec.next_step()


def run_torch(args, data=None, *, rank: int = 0, world: int = 1, show: bool = True):
    """Trains with plain PyTorch (fused AdamW, autograd accumulation, clip_grad_norm_).

    Returns (records, final params): one record per step with loss per token, the norm
    before clipping (float and bits), the step's lr, the clip flag and state digests.
    """
    torch.manual_seed(args.seed)
    data = data if data is not None else corpus(args)
    model = build_model(args)
    params = list(model.parameters())
    named = list(model.named_parameters())
    rec = make_recorder(args, "torch", rank=rank,
                        extra={"formula": "torch.optim.AdamW(fused=True)", "offload": None})
    opt = torch.optim.AdamW(params, lr=args.lr, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, make_schedule(args.warmup, args.steps))
    records = []
    for s, mbs in enumerate(data):
        tokens = step_tokens(mbs)  # global, before the first forward
        lr = opt.param_groups[0]["lr"]
        loss_sum = 0.0
        for mb in local_share(mbs, rank, world):
            loss = model_loss_sum(model, mb)
            loss.backward()
            loss_sum += float(loss.detach())
        grads = [p.grad for p in params if p.grad is not None]
        if world > 1:
            import torch.distributed as dist
            for g in grads:
                dist.all_reduce(g)
        torch._foreach_mul_(grads, 1.0 / tokens)
        norm = torch.nn.utils.clip_grad_norm_(params, args.max_norm)
        opt.step()
        if rec is not None:
            record_torch_step(rec, named, opt, norm, args.max_norm)
        sched.step()
        opt.zero_grad(set_to_none=True)
        rec_ = {"loss": all_reduce_sum(loss_sum, world) / tokens, "norm": float(norm),
                "norm_bits": int(bits(norm)[0]), "lr": lr,
                "clipped": float(norm) > args.max_norm,
                "digests": state_digests(params, opt.state_dict())}
        records.append(rec_)
        print_step("torch", s, rec_, show)
    if rec is not None:
        rec.close()
    return records, [p.detach().clone() for p in params]


def shard(model: nn.Module) -> nn.Module:
    """FSDP2: every block and the root fully_shard-ed (params become Shard(0) DTensors)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def run_stepcore(args, offload: str, overlap: bool, data=None, *, rank: int = 0,
                 world: int = 1, show: bool = True, fsdp: bool = False, record_tag=None):
    """Trains with stepcore.torch.GradientManager in mode `offload`, optimizer-in-backward if `overlap`.

    Returns (records, final params) like run_torch (each record also holds the step's
    report()). With overlap each chunk is stepped during the final backward as if
    unclipped (args.speculation says which), and clip_grad_norm_ then commits those
    chunks or rolls them back and steps them again with the coefficient: the same bits as
    without overlap. With `fsdp` the
    model is sharded over the ranks (FSDP2) and every rank runs every micro-batch: each
    rank's shard of the gradient is the 1-process gradient's, and the manager's norm is
    global over the shards. With --record the run records into args.record/<record_tag>
    (default: stepcore-<mode>[-overlap][-fsdp]; FSDP runs record every rank's shards).
    """
    from stepcore.torch import GradientManager

    torch.manual_seed(args.seed)
    data = data if data is not None else corpus(args)
    model = build_model(args)
    if fsdp:
        model = shard(model)
    params = list(model.parameters())
    run_tag = record_tag or (f"stepcore-{offload}{'-overlap' if overlap else ''}"
                             f"{'-fsdp' if fsdp else ''}")
    # Under torch.distributed a run of rank 0 alone records as rank 0 without collectives.
    recorder = make_recorder(args, run_tag, rank=None if fsdp else rank)
    gm = GradientManager(model, offload=offload, optimizer="adamw", lr=args.lr, betas=BETAS,
                         eps=EPS, weight_decay=WEIGHT_DECAY, threads=args.threads or None,
                         formula=args.formula, recorder=recorder,
                         speculation=args.speculation)
    try:
        sched = torch.optim.lr_scheduler.LambdaLR(gm, make_schedule(args.warmup, args.steps))
        records = []
        tag = f"stepcore {offload}{' overlap' if overlap else ''}"
        for s, mbs in enumerate(data):
            tokens = step_tokens(mbs)
            lr = gm.param_groups[0]["lr"]
            gm.begin_step(1.0 / tokens, overlap_optimizer=overlap)
            local = mbs if fsdp else local_share(mbs, rank, world)
            loss_sum = 0.0
            for k, mb in enumerate(local):
                gm.begin_backward(final_backward=(k == len(local) - 1))
                loss = model_loss_sum(model, mb)
                loss.backward()
                gm.finish_backward()
                loss_sum += float(loss.detach())
            norm = gm.clip_grad_norm_(args.max_norm)  # with or without overlap
            gm.step()
            sched.step()
            rep = gm.report()
            rec = {"loss": (loss_sum if fsdp else all_reduce_sum(loss_sum, world)) / tokens,
                   "norm": float(norm), "norm_bits": int(bits(norm)[0]),
                   "lr": lr, "clipped": float(norm) > args.max_norm,
                   "digests": state_digests(params, gm.state_dict()), "report": rep}
            records.append(rec)
            print_step(tag, s, rec, show)
        return records, [p.detach().clone() for p in params]
    finally:
        gm.close()
        if recorder is not None:
            recorder.close()


# ---- comparisons ---------------------------------------------------------------------


def same_bits(runs: dict[str, tuple]) -> tuple[bool, str]:
    """Returns whether every run has the same digests and norm bits at every step, and the first difference."""
    names = list(runs)
    ref = runs[names[0]][0]
    for name in names[1:]:
        recs = runs[name][0]
        for s, (a, b) in enumerate(zip(ref, recs)):
            for key, value in a["digests"].items():
                if b["digests"][key] != value:
                    return False, f"{name} differs from {names[0]} in {key} after step {s + 1}"
            if a["norm_bits"] != b["norm_bits"]:
                return False, f"{name} differs from {names[0]} in the norm of step {s + 1}"
    return True, ""


def speculation_counts(run: tuple) -> tuple[int, int, int]:
    """Returns a run's chunks speculated, committed and rolled back, summed over its steps."""
    keys = ("chunks_speculated", "chunks_committed", "chunks_rolled_back")
    return tuple(sum(r["report"][k] for r in run[0]) for k in keys)


def overlap_line(runs: dict[str, tuple], overlap_runs: dict[str, tuple]) -> tuple[bool, str]:
    """Returns whether every mode's overlapped run has its non-overlapped run's bits at
    every step, and the `bitwise:` line saying so with each run's speculation counts."""
    whys = []
    for mode in overlap_runs:
        ok, why = same_bits({f"{mode}": runs[mode], f"{mode} overlap": overlap_runs[mode]})
        if not ok:
            whys.append(why)
    steps = len(next(iter(overlap_runs.values()))[0])
    counts = "; ".join(f"{mode} {s} speculated, {c} committed, {b} rolled back"
                       for mode, (s, c, b) in ((m, speculation_counts(r))
                                               for m, r in overlap_runs.items()))
    line = (f"bitwise: overlapped runs (modes {', '.join(overlap_runs)}) "
            f"{'identical' if not whys else 'NOT identical'} to their non-overlapped runs in "
            "params, exp_avg, exp_avg_sq, step and norm after every step"
            + (f" ({'; '.join(whys)})" if whys else "")
            + f"; chunks over {steps} steps: {counts}")
    return not whys, line


def compare_with_torch(base: tuple, run: tuple, max_norm: float) -> str:
    """Returns the line comparing a stepcore run (without overlap) with the baseline."""
    (brecs, bparams), (srecs, sparams) = base, run
    dloss = max(abs(a["loss"] - b["loss"]) for a, b in zip(brecs, srecs))
    dparam = max(float((a - b).abs().max()) for a, b in zip(bparams, sparams))
    first = next((s for s, (a, b) in enumerate(zip(brecs, srecs)) if a["digests"] != b["digests"]), None)
    norm_diff = [s for s, (a, b) in enumerate(zip(brecs, srecs)) if a["norm_bits"] != b["norm_bits"]]
    clipped = sum(1 for r in brecs if r["clipped"])
    line = (f"vs torch: max |loss diff| {dloss:.3e} over {len(brecs)} steps, "
            f"max |final param diff| {dparam:.3e}; ")
    if first is None:
        return line + ("bitwise identical to the baseline at every step (the norms agreed in "
                       "every bit, or no step was clipped)")
    where = (f"first norm difference at step {norm_diff[0] + 1}" if norm_diff
             else "the norms agreed in every bit")
    return line + (
        f"state first differs after step {first + 1} ({where}; {clipped} of {len(brecs)} "
        f"baseline steps clipped at max_norm {max_norm}). Not bitwise because of the norm's "
        "rounding: stepcore's norm is exact (correctly rounded), torch's foreach norm (f32 "
        "per-tensor sums, then the norm of those) is not, so on a clipped step the "
        "coefficient max_norm/(norm+1e-6) differs in the last bits and the trajectories "
        "separate slowly; the AdamW update itself is torch's fused formula bit for bit")


# ---- driver --------------------------------------------------------------------------


def corpus(args):
    """Returns the steps of micro-batches for `args` (deterministic in args.seed)."""
    return make_steps(args.steps, args.micro_batches, vocab=args.vocab, context=args.context,
                      rows=args.rows, seed=args.seed)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the options of the model, its corpus and its step loop (every tiny-LM example's)."""
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--micro-batches", type=int, default=3)
    p.add_argument("--rows", type=int, default=6, help="sequences per micro-batch (varied by +-1)")
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-3, help="peak lr")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads (0: torch's default; 1 is fastest for this model "
                        "and does not spin on busy cores)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)


def parse_args(argv=None):
    """Returns the command line's options."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(p)
    p.add_argument("--threads", type=int, default=0, help="stepcore engine threads (0: its default)")
    p.add_argument("--processes", type=int, default=1,
                   help="gloo processes sharding the model (FSDP2), each running every batch")
    p.add_argument("--formula", choices=("torch", "native"), default="torch",
                   help="stepcore's AdamW formula (torch: torch's fused kernel bit for bit)")
    p.add_argument("--speculation", choices=("auto", "always", "never"), default="auto",
                   help="which chunks an overlapped step steps before clip_grad_norm_ decides "
                        "(docs/managers.md, \"With overlap\"); every choice gives the same bits")
    p.add_argument("--quiet", action="store_true", help="summary lines only")
    p.add_argument("--record", metavar="DIR",
                   help="record every run's tensors after each step into DIR/<run tag>/ "
                        "(stepcore.diff; compare with python -m stepcore.diff)")
    return p.parse_args(argv)


def setup_determinism(args, threads: int) -> None:
    """Seeds torch, asks for deterministic kernels and fixes the intra-op thread count."""
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    if threads > 0:
        torch.set_num_threads(threads)


def run_all(args, rank: int = 0, world: int = 1) -> int:
    """Runs the baseline and every stepcore mode on this rank, printing on rank 0; returns the exit code."""
    if world > 1:
        return run_sharded(args, rank, world)
    show = rank == 0
    say = print if show else (lambda *a, **k: None)
    data = corpus(args)
    t0 = time.perf_counter()
    base = run_torch(args, data, show=show and not args.quiet)
    elapsed = time.perf_counter() - t0
    brecs = base[0]
    say(f"torch baseline: {len(brecs)} steps in {elapsed:.2f} s, loss {brecs[0]['loss']:.4f} -> "
        f"{brecs[-1]['loss']:.4f}", flush=True)
    try:
        from stepcore.torch import GradientManager  # noqa: F401
    except ImportError as e:
        say(f"stepcore.torch.GradientManager is not available ({e}); ran the plain-PyTorch "
            "baseline only")
        return 0
    runs, overlap_runs = {}, {}
    for offload in MODES:
        runs[offload] = run_stepcore(args, offload, False, data, show=show and not args.quiet)
    for offload in MODES:
        overlap_runs[offload] = run_stepcore(args, offload, True, data,
                                             show=show and not args.quiet)
    ok, why = same_bits(runs)
    say(f"bitwise: modes {', '.join(runs)} {'identical' if ok else 'NOT identical'} in params, "
        f"exp_avg, exp_avg_sq, step and norm after every step" + ("" if ok else f" ({why})"))
    ok2, why2 = same_bits(overlap_runs)
    say(f"bitwise (overlap): modes {', '.join(overlap_runs)} "
        f"{'identical' if ok2 else 'NOT identical'} after every step" + ("" if ok2 else f" ({why2})"))
    ok3, line = overlap_line(runs, overlap_runs)
    say(line)
    say(compare_with_torch(base, runs[MODES[0]], args.max_norm))
    return 0 if ok and ok2 and ok3 else 1


def run_sharded(args, rank: int, world: int) -> int:
    """`world` processes under FSDP2, every mode; rank 0 also runs the 1-process loop and
    compares: the norms, and (formula native) every bit."""
    import torch.distributed as dist

    say = print if rank == 0 else (lambda *a, **k: None)
    data = corpus(args)
    single = None
    if rank == 0:  # no collectives: a plain model and manager in this process alone
        single = run_stepcore(args, "none", False, data, show=False,
                              record_tag="stepcore-none-single")
    dist.barrier()
    runs = {}
    for offload in MODES:
        runs[offload] = run_stepcore(args, offload, False, data, rank=rank, world=world,
                                     show=rank == 0 and not args.quiet, fsdp=True)
    if rank != 0:
        return 0
    ok, why = same_bits(runs)
    say(f"bitwise: {world} processes (FSDP2), modes {', '.join(runs)} "
        f"{'identical' if ok else 'NOT identical'} after every step" + ("" if ok else f" ({why})"))
    recs = runs[MODES[0]][0]
    norms_same = all(a["norm_bits"] == b["norm_bits"] for a, b in zip(single[0], recs))
    first = next((s for s, (a, b) in enumerate(zip(single[0], recs))
                  if a["digests"] != b["digests"]), None)
    say(f"vs 1 process: norms {'identical' if norms_same else 'NOT identical'} at every step; "
        + ("params, exp_avg, exp_avg_sq and step identical after every step"
           if first is None else f"state first differs after step {first + 1}"))
    if args.formula == "torch" and first is not None:
        say("  (formula torch is torch's fused kernel, whose scalar tail takes each tensor's "
            "last numel % 8 elements: on shards, each shard's, as torch.optim.AdamW(fused=True) "
            "on FSDP2 shards does; formula native is elementwise and gives the 1-process bits)")
    same = ok and norms_same and (first is None or args.formula == "torch")
    return 0 if same else 1


def ranks_agree(params: list[torch.Tensor], world: int) -> bool:
    """Returns whether every rank holds the same bits in `params` (a collective call)."""
    import torch.distributed as dist
    mine = torch.tensor(list(bytes.fromhex(digest(params))), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], e) for e in everyone)


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, args, codes) -> None:
    """One data-parallel rank: joins the gloo group, runs everything, records its exit code."""
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    setup_determinism(args, args.torch_threads or 1)  # ranks share the cores
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        codes[rank] = run_all(args, rank, world)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    """Parses the options and runs in this process or on --processes gloo ranks."""
    args = parse_args(argv)
    if args.processes <= 1:
        setup_determinism(args, args.torch_threads)
        return run_all(args)
    import torch.multiprocessing as mp
    codes = mp.get_context("spawn").Array("i", [1] * args.processes)
    mp.spawn(_worker, args=(args.processes, free_port(), args, codes), nprocs=args.processes)
    return max(codes[:])


if __name__ == "__main__":
    sys.exit(main())
