"""stepcore.torch's drop-in optimizers, one per optimizer of the table, and the lookup
``optimizer_class(name)``: which drop-in steps which optimizer is each class's ``_UNIT``.

A class holds only what is its own: torch's constructor signature and checks (or
lion-pytorch's, or stepcore's), and where torch's state layout differs from the table's
(a step counter torch does not keep, state created at once or slot by slot); the
hyper-parameters, slots and step counting come from the optimizer table
(``_torch_engine._EngineOptimizer``).
"""

from __future__ import annotations

import torch

from . import _table
from ._torch_checks import _unsupported
from ._torch_engine import _EngineOptimizer
from ._torch_q8 import eight_bit_classes


def _torch_defaults(cls, *args, **kwargs) -> dict:
    """Runs torch.optim.<cls>'s constructor on a placeholder param, so the arguments get
    torch's own checks (its exception types and messages, for this torch version), and
    returns its defaults: torch's param_groups keys, in its order."""
    return dict(cls([torch.zeros(0)], *args, **kwargs).defaults)


def _refuse_unfused(fused, differentiable, capturable=False) -> None:
    """Refuses the options stepcore does not compute (after torch's own checks passed)."""
    _unsupported("fused", fused, (None, True))
    _unsupported("differentiable", differentiable, (False,))
    _unsupported("capturable", capturable, (False,))


# ---- Adam, AdamW -----------------------------------------------------------------------


class Adam(_EngineOptimizer):
    """Adam on stepcore's CPU engine: formula "torch" equals torch.optim.Adam(fused=True)
    bit for bit (decoupled_weight_decay=True: torch.optim.AdamW(fused=True))."""

    _UNIT = "adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False,
                 formula="torch", threads=0, isa=None):
        """torch.optim.Adam's arguments (checked by torch), plus stepcore's formula
        ("torch" or "torchao", docs/numerics.md 8a, 8e), threads and isa."""
        _unsupported("formula", formula,
                     _table.choices(_table.entry(self._UNIT, type(self).__name__), "formula"))
        defaults = _torch_defaults(
            torch.optim.Adam, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
            maximize=maximize, capturable=capturable, differentiable=differentiable,
            fused=fused, decoupled_weight_decay=decoupled_weight_decay)
        _refuse_unfused(fused, differentiable, capturable)
        defaults.update(foreach=None, fused=True, formula=formula)
        self._setup(params, defaults, isa, threads)

    def _engine_name(self, group):
        """AdamW for a group with decoupled weight decay (torch's AdamW is such an Adam)."""
        return "adamw" if group.get("decoupled_weight_decay", False) else "adam"


class AdamW(Adam):
    """AdamW on stepcore's CPU engine; formula "torch" equals torch.optim.AdamW(fused=True)."""

    _UNIT = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, formula="torch", threads=0, isa=None):
        """torch.optim.AdamW's arguments (checked by torch), plus stepcore's formula
        ("torch", "native" or "torchao", docs/numerics.md 7, 8e), threads and isa."""
        _unsupported("formula", formula,
                     _table.choices(_table.entry(self._UNIT, type(self).__name__), "formula"))
        defaults = _torch_defaults(
            torch.optim.AdamW, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
            foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)
        _refuse_unfused(fused, differentiable, capturable)
        defaults.update(foreach=None, fused=True, formula=formula)
        self._setup(params, defaults, isa, threads)

    def __setstate__(self, state):
        """As torch's AdamW: a loaded group is decoupled (Adam's state continues as AdamW)."""
        super().__setstate__(state)
        for group in self.param_groups:
            group["decoupled_weight_decay"] = True


# ---- SGD -------------------------------------------------------------------------------


class SGD(_EngineOptimizer):
    """SGD on stepcore's CPU engine: equals torch.optim.SGD(fused=True) bit for bit."""

    _UNIT = "sgd"
    _STEP_IN_STATE = False  # torch's SGD keeps no step; the first step is the one without a buffer
    _INIT_ALL_AT_ONCE = False  # the buffer alone, created on the param's first step
    _SKIP_DROPS_CREATED = True  # a skipped first step leaves the next one the first
    _REFUSED_GROUP_KEYS = ("differentiable",)

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0,
                 nesterov=False, *, maximize=False, foreach=None, differentiable=False,
                 fused=None, threads=0, isa=None):
        """torch.optim.SGD's arguments (checked by torch), plus the engine's threads, isa."""
        defaults = _torch_defaults(
            torch.optim.SGD, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize,
            foreach=foreach, differentiable=differentiable, fused=fused)
        _refuse_unfused(fused, differentiable)
        defaults.update(foreach=None, fused=True)
        self._setup(params, defaults, isa, threads)


# ---- Adagrad ---------------------------------------------------------------------------


class Adagrad(_EngineOptimizer):
    """Adagrad on stepcore's CPU engine: equals torch.optim.Adagrad(fused=True) bit for bit."""

    _UNIT = "adagrad"
    # torch fills `sum` with the constructor's initial_accumulator_value, for every group
    # (a group's own value is not used): the engine validates that one.
    _FROM_DEFAULTS = ("initial_accumulator_value",)
    _REFUSED_GROUP_KEYS = ("differentiable",)

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0, initial_accumulator_value=0,
                 eps=1e-10, foreach=None, *, maximize=False, differentiable=False, fused=None,
                 threads=0, isa=None):
        """torch.optim.Adagrad's arguments (checked by torch), plus the engine's threads, isa.
        As torch does, every param's state (step, sum) is created here."""
        defaults = _torch_defaults(
            torch.optim.Adagrad, lr, lr_decay, weight_decay, initial_accumulator_value, eps,
            foreach, maximize=maximize, differentiable=differentiable, fused=fused)
        _refuse_unfused(fused, differentiable)
        defaults.update(foreach=None, fused=True)
        self._setup(params, defaults, isa, threads)
        for gi, group in enumerate(self.param_groups):
            name, h = self._group_hyper(gi, group)
            for p in group["params"]:
                self._init_state(p, self.state[p], name, h)

    def share_memory(self) -> None:
        """Calls tensor.share_memory_() on the state sum tensors (as torch's Adagrad)."""
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["sum"].share_memory_()


# ---- Lion ----------------------------------------------------------------------------


class Lion(_EngineOptimizer):
    """Lion on stepcore's CPU engine (docs/numerics.md 8d; torch has none):
    p -= lr*sign(beta1*m + (1-beta1)*g) with decoupled weight decay, then
    m = beta2*m + (1-beta2)*g. The arguments and state layout of lion-pytorch (one
    `exp_avg` per param, no step counter); GradScaler as the fused torch optimizers."""

    _UNIT = "lion"
    _INIT_ALL_AT_ONCE = False  # exp_avg, created on the param's first step
    _REFUSED_GROUP_KEYS = ()

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, threads=0,
                 isa=None):
        """Creates the optimizer; every group's hyper-parameters are checked by the engine
        (ValueError naming the group's key)."""
        self._setup(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), isa, threads)
        for gi, group in enumerate(self.param_groups):
            self._group_hyper(gi, group)


# ---- SignSGD -------------------------------------------------------------------------


class SignSGD(_EngineOptimizer):
    """SignSGD on stepcore's CPU engine: p = p*(1 - lr*wd) - lr*sign(g) (docs/numerics.md 8)."""

    _UNIT = "sign_sgd"
    _step_supports_amp_scaling = False  # GradScaler unscales (sign is unchanged) and skips
    _REFUSED_GROUP_KEYS = ()

    def __init__(self, params, lr=1e-3, weight_decay=0.0, *, threads=0, isa=None):
        """Creates the optimizer (no state)."""
        self._setup(params, dict(lr=lr, weight_decay=weight_decay), isa, threads)


# ---- the lookup ------------------------------------------------------------------------


def _drop_ins():
    """Every drop-in class: the subclasses of _EngineOptimizer that declare a unit."""
    out, todo = [], [_EngineOptimizer]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls._UNIT is not None and cls.__module__ == __name__:
            out.append(cls)
    return out


def optimizer_class(name, *, q8=False):
    """Returns the stepcore.torch optimizer class that steps the optimizer named `name`
    (one of stepcore.optimizer_table()'s names): e.g. "adamw" -> AdamW, "lion" -> Lion;
    with q8=True its 8-bit class ("adamw" -> AdamW8bit). ValueError for a name the table
    does not have; NotImplementedError naming the optimizer when the table has it but
    stepcore.torch has no such drop-in (with q8: its table entry's 'q8' is False)."""
    _table.entry(name, "stepcore.torch.optimizer_class")
    if q8:
        cls = EIGHT_BIT.get(name)
        if cls is None:
            raise NotImplementedError(
                f"stepcore.torch: optimizer {name!r} takes no 8-bit state "
                "(stepcore.optimizer_table()'s 'q8' is False)")
        return cls
    for cls in _drop_ins():
        if cls._UNIT == name:
            return cls
    raise NotImplementedError(
        f"stepcore.torch: optimizer {name!r} (stepcore.optimizer_table()) has no drop-in "
        "torch.optim.Optimizer in stepcore.torch; step it through Engine.step or "
        "stepcore.torch.GradientManager(optimizer=...)")


# The 8-bit drop-ins, one per drop-in whose table entry takes 8-bit state (AdamW8bit, ...).
EIGHT_BIT = eight_bit_classes(_drop_ins())
globals().update({cls.__name__: cls for cls in EIGHT_BIT.values()})
