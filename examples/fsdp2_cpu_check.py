"""Checks what FSDP2 (torch.distributed.fsdp.fully_shard) does on CPU with gloo in this torch.

Two spawned gloo processes on 127.0.0.1 shard a tiny two-layer MLP (per layer, then the
root), run forward and backward, and report, on rank 0: the params' type and local shard
shapes (including an uneven split), whether a post-accumulate-grad hook fires on each
sharded DTensor param per backward and what its grad is, how the reduced gradient relates
to the whole batch's (averaged or summed), what `set_requires_gradient_sync(False)` does to
the hook, and whether a sum reduction (`set_gradient_divide_factor(1.0)` on every FSDP
module, alone or with `set_force_sum_reduction_for_comms(True)`) works over gloo.
Each check runs in processes of its own, so one that kills a rank cannot spoil the others.

Run: /opt/torchenv/py examples/fsdp2_cpu_check.py   (no stepcore needed; about 20 s)
"""

from __future__ import annotations

import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_models():
    """Returns (reference, copy) of a tiny MLP whose second layer's 5 rows split unevenly on 2 ranks."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    model.load_state_dict(ref.state_dict())
    return ref, model


def inputs(world: int):
    """Returns each rank's input batch (seeded by rank)."""
    return [torch.randn(3, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]


def check(rank: int, world: int, name: str) -> str:
    """Runs check `name` on this rank and returns its finding (one line)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    ref, model = make_models()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    xs = inputs(world)
    if name == "hooks":
        fired = []
        for pname, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda p, pname=pname: fired.append(
                    (pname, type(p.grad).__name__, tuple(p.grad.to_local().shape))))
        model(xs[rank]).sum().backward()
        first = len(fired)
        model(xs[rank]).sum().backward()
        shards = [(n, type(p).__name__, tuple(p.to_local().shape)) for n, p in model.named_parameters()]
        return (f"params {shards}; hook fired {first} times in backward 1 and {len(fired) - first} "
                f"in backward 2, grads {sorted(set((f[0], f[1], f[2]) for f in fired))}")
    if name == "reduction":
        model(xs[rank]).sum().backward()
        sum(ref(x).sum() for x in xs).backward()
        full = model[2].weight.grad.full_tensor()
        return (f"grad is the whole batch's mean over ranks: "
                f"{torch.allclose(full, ref[2].weight.grad / world)}, its sum: "
                f"{torch.allclose(full, ref[2].weight.grad)}")
    if name == "no_sync":
        fired = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: fired.append(isinstance(p.grad, DTensor)))
        model.set_requires_gradient_sync(False)
        model(xs[rank]).sum().backward()
        during = len(fired)
        model.set_requires_gradient_sync(True)
        model(xs[rank]).sum().backward()
        return (f"with set_requires_gradient_sync(False) the hook fired {during} times; the next "
                f"synced backward fired it {len(fired) - during} times (DTensor grads: {all(fired)})")
    if name in ("divide_factor", "divide_factor_sum_only"):
        for m in (model, model[0], model[2]):  # per FSDP module: the root's own does not reach the layers
            m.set_gradient_divide_factor(1.0)
            if name == "divide_factor_sum_only":
                m.set_force_sum_reduction_for_comms(True)
        model(xs[rank]).sum().backward()
        sum(ref(x).sum() for x in xs).backward()
        return f"grad equals the sum over ranks: {torch.allclose(model[2].weight.grad.full_tensor(), ref[2].weight.grad)}"
    raise ValueError(name)


def worker(rank: int, world: int, port: int, name: str, results) -> None:
    """One rank of one check: joins gloo, runs it, stores rank 0's finding."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        line = check(rank, world, name)
    except Exception as e:  # the finding is the error
        line = f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if os.environ.get("FSDP2_CHECK_TRACE"):
            traceback.print_exc()
    if rank == 0:
        results[name] = line
    dist.destroy_process_group()


def main() -> int:
    """Runs every check in fresh processes and prints one line each."""
    print(f"torch {torch.__version__}, backend gloo, 2 CPU processes")
    manager = mp.Manager()
    results = manager.dict()
    for name in ("hooks", "reduction", "no_sync", "divide_factor", "divide_factor_sum_only"):
        try:
            mp.spawn(worker, args=(2, free_port(), name, results), nprocs=2)
        except Exception as e:  # a rank that died (signal) ends the check
            results.setdefault(name, f"a rank died: {type(e).__name__}: {e}")
        print(f"{name}: {results.get(name, 'no result')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
