"""stepcore.torch.clip_grad_norm_: torch.nn.utils.clip_grad_norm_'s signature with the
correctly rounded, order-independent norm (exact across ranks and DTensor shardings:
norm partials all-reduced as int64 words), and torch's clip multiply.
"""

from __future__ import annotations

import math
import threading
import types
import warnings

import numpy as np
import torch

from . import _core
from ._torch_checks import _GRAD_DTYPES, _check_tensor, _is_dtensor

_engines = {}
_engines_lock = threading.Lock()


def _default_engine():
    """Returns the process-wide engine for norms (the engine is thread-safe)."""
    with _engines_lock:
        e = _engines.get(None)
        if e is None:
            e = _engines[None] = _core.Engine()
        return e


def _local_grads(parameters):
    """Returns (local grads to scale, local grads this rank counts, DTensor meshes)."""
    scale, counted, meshes = [], [], []
    for i, p in enumerate(parameters):
        g = p.grad
        if g is None:
            continue
        name = f"parameters[{i}].grad"
        if _is_dtensor(g):
            placements = g.placements
            for d, pl in enumerate(placements):
                if pl.is_partial():
                    raise NotImplementedError(
                        f"stepcore.torch: '{name}' has a Partial placement on mesh dimension "
                        f"{d}; reduce it (redistribute) before computing the norm")
            mesh = g.device_mesh
            if all(m is not mesh for m in meshes):
                meshes.append(mesh)
            local = g.to_local()
            coord = mesh.get_coordinate()
            counts = coord is not None and all(
                coord[d] == 0 for d, pl in enumerate(placements) if pl.is_replicate())
        else:
            local, counts = g, True
        _check_tensor(local, name, _GRAD_DTYPES, role="gradient")
        scale.append(local)
        if counts:
            counted.append(local.detach())
    return scale, counted, meshes


def _reduce_group(process_group, meshes):
    """Returns the process group the partials are combined over."""
    import torch.distributed as dist

    if process_group is not None:
        return process_group
    if len(meshes) == 1 and meshes[0].ndim == 1:
        return meshes[0].get_group(0)
    if all(m.size() == dist.get_world_size() for m in meshes):
        return dist.group.WORLD
    raise ValueError("stepcore.torch: 'process_group' is needed: the gradients' device meshes "
                     "do not span the default group (pass the group covering all of them)")


def _combine(partial, group):
    """All-reduces a norm partial exactly: SUM of every word, MAX of the max_abs word."""
    import torch.distributed as dist

    device = "cpu"
    if "nccl" in str(dist.get_backend(group)):
        device = torch.device("cuda", torch.cuda.current_device())
    words = torch.from_numpy(np.array(partial, dtype=np.int64)).to(device)
    mx = words[_core.PARTIAL_MAX_ABS_WORD:_core.PARTIAL_MAX_ABS_WORD + 1].clone()
    words[_core.PARTIAL_MAX_ABS_WORD] = 0
    dist.all_reduce(words, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=group)
    words[_core.PARTIAL_MAX_ABS_WORD] = mx[0]
    return words.cpu().numpy()


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None,
                    *, process_group=None):
    """torch.nn.utils.clip_grad_norm_ with the exact (correctly rounded) total norm."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)
        if is_generator and not parameters:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.",
                          stacklevel=3)
    norm_type = float(norm_type)  # torch's conversion: its TypeError / ValueError
    max_norm = float(max_norm)
    scale, counted, meshes = _local_grads(parameters)
    distributed = process_group is not None or bool(meshes)
    if not scale and not distributed:
        return torch.tensor(0.0)
    partial_order = {2.0: 2, math.inf: 2, 1.0: 1}.get(norm_type)
    if distributed and partial_order is None:
        raise NotImplementedError(
            f"stepcore.torch: norm_type={norm_type} is not supported with a process group or "
            "DTensor gradients (2.0, 1.0 or inf)")

    engine = _default_engine()
    if partial_order is not None:
        # 2, 1: the exact partial (summed across ranks); inf: its max |x| word.
        group = _reduce_group(process_group, meshes) if distributed else None

        def norm_of(exact):
            partial = engine.norm_partial(counted, exact=exact, order=partial_order)
            if distributed:
                partial = _combine(partial, group)
            return _core.finalize(partial, partial_order)

        norm, finite, max_abs, needs_exact = norm_of(False)
        if needs_exact and norm_type != math.inf:
            # Every rank sees the same combined partial, so every rank takes this branch.
            norm, finite, max_abs, needs_exact = norm_of(True)
        total = max_abs if norm_type == math.inf else norm
    elif math.isnan(norm_type):
        total = math.nan  # torch: a NaN order gives a NaN norm
    elif norm_type == 0.0:
        # torch's total is the 0-"norm" of the per-gradient 0-norms: the number of
        # gradients holding a non-zero (NaN and Inf included) value (docs/python.md).
        total = float(sum(1 for g in counted if engine.p_norm([g], 0.0)[0] != 0.0))
    else:
        total = engine.p_norm(counted, norm_type)[0]  # -inf and any other p: 6.6
    total_t = torch.tensor(total, dtype=torch.float32)
    if error_if_nonfinite and (math.isnan(total) or math.isinf(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    if scale:
        coef = torch.tensor(_core.clip_coefficient(total, max_norm), dtype=torch.float32)
        by_dtype = {}
        for t in scale:
            by_dtype.setdefault(t.dtype, []).append(t)
        for ts in by_dtype.values():
            torch._foreach_mul_(ts, coef)  # as torch does, also when coef == 1
    return total_t
