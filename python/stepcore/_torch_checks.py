"""stepcore.torch's argument checks (all run before anything is written): the dtypes the
optimizers step, tensors (dense, contiguous, CPU, a known dtype), params, grads and
hyper-parameter values, each raising with the argument's name; and the small helpers
the optimizers share (detached views for DLPack, autograd version bumps).
"""

from __future__ import annotations

import torch


# The param dtypes the optimizers step (the cached rows' C check, python/src/module.cpp,
# mirrors it): f32, and bf16/f16 with the state in the param's dtype, as torch's fused
# kernels keep it (math in f32, each store rounded to nearest even: docs/numerics.md 7.3).
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

try:  # DTensor lives in torch.distributed, which some builds lack.
    from torch.distributed.tensor import DTensor as _DTensor
except Exception:  # pragma: no cover - torch without distributed
    _DTensor = None


def _is_dtensor(t) -> bool:
    """Returns whether `t` is a torch.distributed.tensor.DTensor."""
    return _DTensor is not None and isinstance(t, _DTensor)


# ---- checks (all before anything is written) ----------------------------------------


def _check_tensor(t, name: str, dtypes, *, numel=None, role="tensor") -> None:
    """Raises (naming `name`) unless `t` is a dense, contiguous CPU tensor of `dtypes`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"stepcore.torch: '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if _is_dtensor(t):
        raise NotImplementedError(
            f"stepcore.torch: '{name}' is a DTensor; DTensor {role}s are not supported")
    if t.layout != torch.strided:
        raise NotImplementedError(
            f"stepcore.torch: '{name}' has layout {t.layout}; sparse {role}s are not supported")
    if t.device.type != "cpu":
        raise NotImplementedError(
            f"stepcore.torch: '{name}' is on device '{t.device}'; non-CPU {role}s are not "
            "supported (the CPU engine reads and writes host memory)")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"stepcore.torch: '{name}' has dtype {t.dtype}; expected {names}")
    if not t.is_contiguous():
        raise ValueError(f"stepcore.torch: '{name}' must be contiguous (strides {t.stride()})")
    if numel is not None and t.numel() != numel:
        raise ValueError(
            f"stepcore.torch: '{name}' has {t.numel()} elements, expected {numel}")


def _check_param(p, name: str) -> None:
    """Raises NotImplementedError for a param stepcore cannot update, naming it."""
    if isinstance(p, torch.Tensor) and p.is_floating_point() and p.dtype not in _PARAM_DTYPES \
            and p.device.type == "cpu" and not _is_dtensor(p):
        if p.dtype == torch.float64:
            why = ("stepcore's optimizers compute in float32 (torch's fused kernels compute "
                   "float64 params in float64)")
        else:
            why = "stepcore steps float32, bfloat16 and float16 params"
        raise NotImplementedError(
            f"stepcore.torch: '{name}' has dtype {p.dtype}; it is not supported: {why}")
    _check_tensor(p, name, _PARAM_DTYPES, role="param")


def _check_grad(p, g, name: str) -> None:
    """Raises unless `g` is a usable gradient of `p`, naming it."""
    if isinstance(g, torch.Tensor) and (g.is_sparse or g.layout != torch.strided):
        raise NotImplementedError(f"stepcore.torch: '{name}' is sparse; sparse gradients "
                                  "are not supported")
    _check_tensor(g, name, _GRAD_DTYPES, role="gradient")
    if g.shape != p.shape:
        raise ValueError(
            f"stepcore.torch: '{name}' has shape {tuple(g.shape)}, the param {tuple(p.shape)}")


def _scalar(x, name: str) -> float:
    """Returns a hyper-parameter (float or one-element tensor) as a Python float."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"stepcore.torch: '{name}' must have one element, got {x.numel()}")
        return float(x.item())
    try:
        return float(x)
    except (TypeError, ValueError):
        raise ValueError(f"stepcore.torch: '{name}' must be a number, got {x!r}") from None


def _engine_checked(fn, where: str):
    """Runs an engine validation call; re-raises its error with `where` prefixed."""
    try:
        fn()
    except (ValueError, TypeError, NotImplementedError) as e:
        raise type(e)(f"stepcore.torch: {where}: {e}") from e


def _unsupported(name: str, value, allowed) -> None:
    """Raises NotImplementedError naming an option stepcore does not implement."""
    if value not in allowed:
        raise NotImplementedError(
            f"stepcore.torch: {name}={value!r} is not supported (allowed: "
            + ", ".join(repr(a) for a in allowed) + ")")


def _detached(ts):
    """Returns the tensors detached (same storage), as DLPack requires."""
    return [t.detach() for t in ts]


def _bump_versions(ts) -> None:
    """Advances the autograd version counters of tensors the engine wrote in place."""
    if ts:
        torch.autograd.graph.increment_version(ts)
