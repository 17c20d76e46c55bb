"""stepcore.torch: PyTorch optimizers and gradient clipping over the stepcore CPU engine.

``Adam``, ``AdamW``, ``SGD`` and ``Adagrad`` are ``torch.optim.Optimizer``s bit-identical to
``torch.optim.Adam/AdamW/SGD/Adagrad(fused=True)`` on CPU with float32 params (constructor
arguments, state layout and ``state_dict`` included; AdamW's ``formula="native"`` is
stepcore's own), ``SignSGD`` is stepcore's SignSGD, and ``clip_grad_norm_`` is
signature-compatible with ``torch.nn.utils.clip_grad_norm_`` but computes the correctly
rounded, order-independent norm (exact across ranks and DTensor shardings). Every optimizer
steps through the engine's one generic entry point (``Engine.step`` by name, over a cached
table of addresses it validated); tensors reach the engine zero-copy, and the engine
releases the GIL. See docs/python.md.
"""

from __future__ import annotations

import math
import operator
import threading
import types
import warnings


import numpy as np
import torch

from . import _core

__all__ = ["Adagrad", "Adam", "AdamW", "GradientManager", "Lion", "SGD", "SignSGD",
           "clip_grad_norm_"]

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


class _ComputeCopies:
    """Per-parameter compute copies (bf16/f16/f32 tensors receiving R(p_new))."""

    def __init__(self):
        self._by_param = {}
        self.generation = 0  # advances on every set(): AdamW's cached tables compare it

    def set(self, param, tensor) -> None:
        """Registers `tensor` as `param`'s compute copy (None removes it)."""
        self.generation += 1
        if tensor is None:
            self._by_param.pop(param, None)
            return
        _check_tensor(tensor, "compute copy", _COMPUTE_DTYPES, numel=param.numel(),
                      role="compute copy")
        if tensor.data_ptr() == param.data_ptr() and tensor.numel():
            raise ValueError("stepcore.torch: 'compute copy' must not share memory with its param")
        self._by_param[param] = tensor

    def get(self, param):
        """Returns `param`'s compute copy or None."""
        return self._by_param.get(param)


class _EngineOwner:
    """Mixin: the engine (isa, threads), compute copies, group and gradient checks."""

    def _init_engine(self, isa, threads) -> None:
        """Creates the engine (the extension validates isa and threads)."""
        if isa is not None and not isinstance(isa, str):
            raise ValueError(f"stepcore.torch: 'isa' must be a string or None, got {isa!r}")
        self._engine = _core.Engine(isa=isa, threads=int(threads))
        self._engine_config = (isa, int(threads))
        self._compute = _ComputeCopies()

    def __getstate__(self):
        """Pickles like torch, plus the engine's (isa, threads); compute copies are not kept."""
        state = dict(super().__getstate__())
        state["_engine_config"] = self._engine_config
        return state

    def _restore_engine(self) -> None:
        """Rebuilds the engine after unpickling (torch's load_state_dict keeps it)."""
        if not hasattr(self, "_engine"):
            self._init_engine(*getattr(self, "_engine_config", (None, 0)))

    @property
    def engine(self):
        """The stepcore._core.Engine this optimizer runs on."""
        return self._engine

    def set_compute_copy(self, param, tensor) -> None:
        """Registers a tensor (bf16/f16/f32, same numel) that receives `param` after every step."""
        for group in self.param_groups:
            if any(p is param for p in group["params"]):
                self._compute.set(param, tensor)
                return
        raise ValueError("stepcore.torch: set_compute_copy: 'param' is not in this optimizer")

    def add_param_group(self, param_group) -> None:
        """Adds a group like torch; a group stepcore cannot step is refused (and not added)."""
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        try:
            self._group_hyper(gi, group)  # ValueError naming a bad hyper-parameter
            for i, p in enumerate(group["params"]):
                _check_param(p, f"param_groups[{gi}]['params'][{i}]")
        except BaseException:
            self.param_groups.pop()
            raise

    def _group_params_with_grads(self, gi, group):
        """Returns [(index, param, grad)] of `group` with gradients, checked."""
        out = []
        for i, p in enumerate(group["params"]):
            name = f"param_groups[{gi}]['params'][{i}]"
            _check_param(p, name)
            g = p.grad
            if g is None:
                continue
            _check_grad(p, g, name + ".grad")
            out.append((i, p, g))
        return out

    def _computes_of(self, gi, entries):
        """Returns the compute list of a group for the engine (None when it has none)."""
        computes = [self._compute.get(p) for _, p, _ in entries]
        if all(c is None for c in computes):
            return None
        for (i, p, _), c in zip(entries, computes):
            if c is not None:
                name = f"compute copy of param_groups[{gi}]['params'][{i}]"
                if p.dtype != torch.float32:
                    raise ValueError(f"stepcore.torch: '{name}': a {p.dtype} param is its own "
                                     "compute copy (compute copies are for float32 params)")
                _check_tensor(c, name, _COMPUTE_DTYPES, numel=p.numel(), role="compute copy")
        return [None if c is None else c.detach() for c in computes]


# ---- the optimizers' cached rows -------------------------------------------------------
#
# A group is checked in full (here, naming every bad argument) when it is first stepped or
# anything about it changed; the result is a _core._OptimizerRows, which re-reads at C speed
# on every step what may change between steps: each param's grad (new grad objects, a grad
# gained or lost), the param's and grad's arrays (so swapped storage is seen; through the
# DLPack C exchange API) and the compute copies, and compares the state dicts' entries the
# optimizer uses (its slots, e.g. exp_avg and exp_avg_sq, and step) by identity. When
# anything no longer matches it writes nothing and the group is checked in full again. Not
# detected (and not supported): swapping a state tensor's storage in place
# (state[p]['exp_avg'].data = ...). Version counters: the params and compute copies, which
# autograd may have saved, advance after every step as torch's in-place update does; the
# state tensors are the optimizer's own and their counters do not advance (docs/python.md).

_grad_of = operator.attrgetter("grad")
_GRAD_TYPES = [torch.Tensor]  # exact types of grads the rows take (others: the full path)


class _GroupRows:
    """One group's cached rows and what the step needs beside them."""

    __slots__ = ("rows", "eparams", "states", "slots", "steps", "computes", "bump",
                 "compute_generation", "usable", "reads", "layout")


def _torch_defaults(cls, *args, **kwargs) -> dict:
    """Runs torch.optim.<cls>'s constructor on a placeholder param, so the arguments get
    torch's own checks (its exception types and messages, for this torch version), and
    returns its defaults: torch's param_groups keys, in its order."""
    return dict(cls([torch.zeros(0)], *args, **kwargs).defaults)


class _EngineOptimizer(_EngineOwner, torch.optim.Optimizer):
    """A torch.optim.Optimizer whose step is one engine optimizer (`Engine.step` by name)
    over cached rows. A subclass defines:

    * ``_engine_name(group)``: the engine's optimizer (``_core.optimizers()``);
    * ``_hyper(where, group)``: the engine's hyper-parameters of a group (a dict);
    * ``_slot_keys(group)``: the state keys of the optimizer's slots in the unit's order;
    * ``_init_state(p, group, st)``: fills p's missing state in torch's layout;
    * ``_COUNTER``: where each param's step counter lives: ``"state"`` (``state['step']``,
      torch's 0-dim float32 tensor), ``"private"`` (torch keeps none: the rows keep one,
      0 exactly when the step creates the param's state, i.e. its first step) or None.
    """

    _step_supports_amp_scaling = True  # GradScaler sets self.grad_scale / self.found_inf
    _COUNTER = "state"
    _SKIP_DROPS_CREATED = False  # found_inf == 1 removes state the step created
    _REFUSED_GROUP_KEYS = ("capturable", "differentiable")  # True in a group: refused

    def _setup(self, params, defaults, isa, threads) -> None:
        """Creates the engine and adds the groups (add_param_group checks each)."""
        self._init_engine(isa, threads)
        self._reset_tables()
        torch.optim.Optimizer.__init__(self, params, defaults)

    def __setstate__(self, state):
        """Restores pickled/loaded state with this optimizer's group keys (fused=True)."""
        super().__setstate__(state)
        self._restore_engine()
        self._reset_tables()
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            if "fused" in self.defaults:
                group["fused"] = True  # so torch continues a stepcore state_dict fused
                group["foreach"] = None

    def load_state_dict(self, state_dict):
        """Loads torch's (fused or not) or stepcore's state_dict of this optimizer."""
        for gi, g in enumerate(state_dict["param_groups"]):
            for key in self._REFUSED_GROUP_KEYS:
                if g.get(key, False):
                    raise NotImplementedError(
                        f"stepcore.torch: the state_dict's param_groups[{gi}] has {key}=True, "
                        f"which stepcore.torch.{type(self).__name__} does not support")
        super().load_state_dict(state_dict)
        # torch keeps `step` as saved for non-fused groups; the engine needs torch's fused
        # layout (a 0-dim float32 CPU tensor) and contiguous f32 state.
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                for key, v in list(st.items()):
                    if key == "step" and self._COUNTER == "state":
                        if not isinstance(v, torch.Tensor):
                            v = torch.tensor(float(v))
                        if v.dtype != torch.float32 or v.device.type != "cpu" or v.dim() != 0:
                            v = v.detach().to(device="cpu", dtype=torch.float32).reshape(())
                        st[key] = v
                    elif isinstance(v, torch.Tensor) and not v.is_contiguous():
                        st[key] = v.contiguous()

    def _group_hyper(self, gi, group):
        """Returns the group's (engine optimizer, hyper-parameters), validated by the engine."""
        where = f"param_groups[{gi}]"
        for key in self._REFUSED_GROUP_KEYS:
            _unsupported(f"{where}['{key}']", group.get(key, False), (False,))
        name = self._engine_name(group)
        h = self._hyper(where, group)
        # The engine validates every hyper-parameter before touching a tensor: with no
        # tensors it only validates, so a bad group is reported before any group steps.
        _engine_checked(lambda: self._engine.step(name, [], [], None, [], hyper=h), where)
        return name, h

    def _state_of(self, gi, i, p, group, keys, created):
        """Returns (p's state, whether this step created it): missing entries initialised as
        torch does (recorded in `created` to be removed if the step fails), then checked."""
        need = keys + (("step",) if self._COUNTER == "state" else ())
        existed = p in self.state
        st = self.state[p]
        fresh = False
        if any(k not in st for k in need):
            before = set(st)
            self._init_state(p, group, st)
            added = [k for k in st if k not in before]
            created.append((p, added, existed))
            fresh = bool(added)
        name = f"state of param_groups[{gi}]['params'][{i}]"
        if self._COUNTER == "state":
            _check_tensor(st["step"], name + "['step']", (torch.float32,), numel=1, role="step")
            t = float(st["step"])
            if not (t.is_integer() and 0 <= t < 2**24 - 1):
                raise ValueError(f"stepcore.torch: '{name}['step']' is {t}; step counters must "
                                 "be integers in [0, 2^24 - 1) (f32 counts exactly below 2^24)")
        for k in keys:
            if k not in st:
                raise ValueError(f"stepcore.torch: '{name}' has no '{k}' (a state_dict of "
                                 "another configuration?)")
            _check_tensor(st[k], f"{name}['{k}']", (p.dtype,), numel=p.numel())  # torch's
        return st, fresh

    def _drop_created(self, created, keep=frozenset()) -> None:
        """Removes state entries a failing (or skipped) step created, except for `keep`'s ids."""
        for p, added, existed in created:
            st = self.state.get(p)
            if id(p) in keep or st is None:
                continue
            for k in added:
                st.pop(k, None)
            if not existed and not st:
                self.state.pop(p, None)

    # ---- the cached rows (see "the optimizers' cached rows" above) ----

    def _reset_tables(self) -> None:
        """Forgets every group's cached rows (state loaded, unpickled or new)."""
        self._tables = {}
        self._state_seen = None

    def _state_unchanged(self) -> bool:
        """Returns whether self.state maps the same params to the same dicts as last step
        (compared in full only when its stamp changed, or where Python keeps none)."""
        seen, s = self._state_seen, self.state
        if seen is None or seen[0] is not s:
            return False
        stamp = _core._dict_stamp(s)
        if stamp != 0 and stamp == seen[3]:
            return True
        same = (len(s) == len(seen[1]) and _core._same_objects(list(s.keys()), seen[1])
                and _core._same_objects(list(s.values()), seen[2]))
        if same:
            self._state_seen = (s, seen[1], seen[2], stamp)
        return same

    def _cached_table(self, gi, keys):
        """Returns the group's cached rows when their layout and computes are current."""
        c = self._tables.get(gi)
        if c is None or c.compute_generation != self._compute.generation or c.layout != keys:
            return None
        return c

    def _new_table(self, gi, group, keys, created):
        """Checks the group in full and caches its rows."""
        self._tables.pop(gi, None)
        entries = self._group_params_with_grads(gi, group)
        stateful = bool(keys) or self._COUNTER == "state"
        states, fresh = [], []
        for i, p, _ in entries:
            if stateful:
                st, f = self._state_of(gi, i, p, group, keys, created)
            else:
                st, f = {}, False  # torch keeps no state here: the rows read none
            states.append(st)
            fresh.append(f)
        computes = self._computes_of(gi, entries)
        c = _GroupRows()
        c.layout = keys
        c.eparams = [p for _, p, _ in entries]
        c.states = states
        c.slots = [[st[k] for st in states] for k in keys]
        if self._COUNTER == "state":
            c.steps = [st["step"] for st in states]
        elif self._COUNTER == "private":
            c.steps = [torch.zeros((), dtype=torch.float32) if f else torch.ones(())
                       for f in fresh]
        else:
            c.steps = None
        c.computes = computes
        c.compute_generation = self._compute.generation
        c.bump = c.eparams + [x for x in (computes or []) if x is not None]
        c.rows = _core._OptimizerRows(
            list(group["params"]), [i for i, _, _ in entries], states, list(keys),
            "step" if self._COUNTER == "state" else None,
            c.steps if self._COUNTER == "private" else None, computes, _GRAD_TYPES)
        c.usable = True
        c.reads = None
        self._tables[gi] = c
        return c

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        """One step over every group (grad_scale/found_inf: torch's fused AMP semantics)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        scale_t = None
        if grad_scale is not None:
            scale_t = torch.as_tensor(grad_scale).detach().to("cpu", torch.float32).reshape(())
        inf_t = None
        if found_inf is not None:
            inf_t = torch.as_tensor(found_inf).detach().to("cpu", torch.float32).reshape(())

        # Pass 1: check everything before any group is written (hyper-parameters through
        # the engine; tensors by the cached rows, or in full when they are stale).
        plans = []
        created = []
        unchanged = self._state_unchanged()
        if not unchanged:
            self._tables.clear()
        try:
            for gi, group in enumerate(self.param_groups):
                name, h = self._group_hyper(gi, group)
                keys = self._slot_keys(group)
                c = self._cached_table(gi, keys)
                if c is None or not self._prepare(c, group, scale_t):
                    c = self._new_table(gi, group, keys, created)
                    c.usable = self._prepare(c, group, scale_t)
                plans.append((name, h, c))
        except BaseException:
            self._drop_created(created)
            self._reset_tables()
            raise
        for gi in [k for k in self._tables if k >= len(self.param_groups)]:
            del self._tables[gi]  # groups that no longer exist
        s = self.state
        if created or not unchanged:
            self._state_seen = (s, list(s.keys()), list(s.values()), _core._dict_stamp(s))

        # torch's fused CPU kernels return at once when found_inf == 1, and the Python side
        # adds 1 to every step before and subtracts found_inf after: nothing changes.
        if inf_t is not None and float(inf_t) == 1.0:
            if self._SKIP_DROPS_CREATED and created:
                self._drop_created(created)
                self._reset_tables()
            return loss

        # Pass 2: one engine call per group.
        for k, (name, h, c) in enumerate(plans):
            if not c.eparams:
                continue
            try:
                if c.usable:
                    c.rows.run(self._engine, name, h)
                else:  # the rows cannot read these tensors (a torch without the C exchange API)
                    self._run_lists(c, name, h)
            except BaseException:
                stepped = {id(p) for _, _, cj in plans[:k] for p in cj.eparams}
                self._drop_created(created, keep=stepped)  # earlier groups' state advanced
                self._reset_tables()
                raise
            if c.reads is not None:
                for p, r in zip(c.eparams, c.reads):
                    p.grad.copy_(r)  # the fused kernels store g / grad_scale in p.grad
                c.reads = None
            if inf_t is not None and float(inf_t) != 0.0 and self._COUNTER == "state":
                torch._foreach_sub_(c.steps, [inf_t] * len(c.steps))  # torch's own bookkeeping
            _bump_versions(c.bump)
        return loss

    def _prepare(self, c, group, scale_t) -> bool:
        """Has the rows re-read the group (with a grad scale: on quotients g / scale)."""
        c.reads = None
        if scale_t is not None:
            # The fused kernels divide (g / grad_scale, f32) and store the quotient in
            # p.grad. Divide out of place so a failing call changes nothing; step() stores.
            grads = list(map(_grad_of, c.eparams))
            if any(g is None for g in grads):
                return False
            c.reads = [torch.div(g.float() if g.dtype != torch.float32 else g, scale_t)
                       for g in grads]
        return c.rows.prepare(group["params"], c.reads)

    def _run_lists(self, c, name, h) -> None:
        """The step through Engine.step on detached tensors (no cached rows)."""
        grads = c.reads if c.reads is not None else list(map(_grad_of, c.eparams))
        self._engine.step(name, _detached(c.eparams), [_detached(s) for s in c.slots],
                          None if c.steps is None else _detached(c.steps), _detached(grads),
                          c.computes, hyper=h)


def _adam_hyper(where, group) -> dict:
    """The engine hyper-parameters of an Adam/AdamW group."""
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"stepcore.torch: {where}['betas'] must be a pair, got {betas!r}")
    h = dict(lr=_scalar(group["lr"], f"{where}['lr']"),
             beta1=_scalar(betas[0], f"{where}['betas'][0]"),
             beta2=_scalar(betas[1], f"{where}['betas'][1]"),
             eps=_scalar(group["eps"], f"{where}['eps']"),
             weight_decay=_scalar(group["weight_decay"], f"{where}['weight_decay']"),
             amsgrad=bool(group.get("amsgrad", False)),
             maximize=bool(group.get("maximize", False)))
    if group.get("decoupled_weight_decay", False):
        h["formula"] = group.get("formula", "torch")
    return h


def _refuse_unfused(fused, differentiable, capturable=False) -> None:
    """Refuses the options stepcore does not compute (after torch's own checks passed)."""
    _unsupported("fused", fused, (None, True))
    _unsupported("differentiable", differentiable, (False,))
    _unsupported("capturable", capturable, (False,))


# ---- Adam, AdamW -----------------------------------------------------------------------


class Adam(_EngineOptimizer):
    """Adam on stepcore's CPU engine: equals torch.optim.Adam(fused=True) bit for bit
    (decoupled_weight_decay=True: torch.optim.AdamW(fused=True))."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, foreach=None, maximize=False, capturable=False,
                 differentiable=False, fused=None, decoupled_weight_decay=False, threads=0,
                 isa=None):
        """torch.optim.Adam's arguments (checked by torch), plus the engine's threads, isa."""
        defaults = _torch_defaults(
            torch.optim.Adam, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
            maximize=maximize, capturable=capturable, differentiable=differentiable,
            fused=fused, decoupled_weight_decay=decoupled_weight_decay)
        _refuse_unfused(fused, differentiable, capturable)
        defaults.update(foreach=None, fused=True)
        self._setup(params, defaults, isa, threads)

    def _engine_name(self, group):
        return "adamw" if group.get("decoupled_weight_decay", False) else "adam"

    def _hyper(self, where, group):
        return _adam_hyper(where, group)

    def _slot_keys(self, group):
        if group.get("amsgrad", False):
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        return ("exp_avg", "exp_avg_sq")

    def _init_state(self, p, group, st):
        """torch's fused Adam state: step, then the moments (and max_exp_avg_sq), zeros."""
        if len(st) == 0:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad", False):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


class AdamW(Adam):
    """AdamW on stepcore's CPU engine; formula "torch" equals torch.optim.AdamW(fused=True)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, foreach=None, capturable=False,
                 differentiable=False, fused=None, formula="torch", threads=0, isa=None):
        """torch.optim.AdamW's arguments (checked by torch), plus stepcore's formula
        ("torch" or "native", docs/numerics.md 7), threads and isa."""
        _unsupported("formula", formula, ("torch", "native"))
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

    _COUNTER = "private"  # torch's SGD keeps no step; the first step is the one without a buffer
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

    def _engine_name(self, group):
        return "sgd"

    def _hyper(self, where, group):
        return dict(lr=_scalar(group["lr"], f"{where}['lr']"),
                    momentum=_scalar(group["momentum"], f"{where}['momentum']"),
                    dampening=_scalar(group["dampening"], f"{where}['dampening']"),
                    weight_decay=_scalar(group["weight_decay"], f"{where}['weight_decay']"),
                    nesterov=bool(group.get("nesterov", False)),
                    maximize=bool(group.get("maximize", False)))

    def _slot_keys(self, group):
        return ("momentum_buffer",) if _scalar(group["momentum"], "momentum") != 0 else ()

    def _init_state(self, p, group, st):
        """The momentum buffer (torch creates it on the first step, which overwrites it)."""
        st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# ---- Adagrad ---------------------------------------------------------------------------


class Adagrad(_EngineOptimizer):
    """Adagrad on stepcore's CPU engine: equals torch.optim.Adagrad(fused=True) bit for bit."""

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
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, group, self.state[p])

    def _engine_name(self, group):
        return "adagrad"

    def _hyper(self, where, group):
        # torch fills `sum` with the constructor's initial_accumulator_value, for every
        # group (a group's own value is not used): the engine validates that one.
        return dict(lr=_scalar(group["lr"], f"{where}['lr']"),
                    lr_decay=_scalar(group["lr_decay"], f"{where}['lr_decay']"),
                    weight_decay=_scalar(group["weight_decay"], f"{where}['weight_decay']"),
                    initial_accumulator_value=_scalar(
                        self.defaults["initial_accumulator_value"], "initial_accumulator_value"),
                    eps=_scalar(group["eps"], f"{where}['eps']"),
                    maximize=bool(group.get("maximize", False)))

    def _slot_keys(self, group):
        return ("sum",)

    def _init_state(self, p, group, st):
        """torch's fused Adagrad state: step, then sum filled with the initial value."""
        if len(st) == 0:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            st["sum"] = torch.full_like(p, self.defaults["initial_accumulator_value"],
                                        memory_format=torch.preserve_format)

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

    _COUNTER = None
    _REFUSED_GROUP_KEYS = ()

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, threads=0,
                 isa=None):
        """Creates the optimizer; every group's hyper-parameters are checked by the engine
        (ValueError naming the group's key)."""
        self._setup(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), isa, threads)
        for gi, group in enumerate(self.param_groups):
            self._group_hyper(gi, group)

    def _engine_name(self, group):
        return "lion"

    def _hyper(self, where, group):
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"stepcore.torch: {where}['betas'] must be a pair, got {betas!r}")
        return dict(lr=_scalar(group["lr"], f"{where}['lr']"),
                    beta1=_scalar(betas[0], f"{where}['betas'][0]"),
                    beta2=_scalar(betas[1], f"{where}['betas'][1]"),
                    weight_decay=_scalar(group["weight_decay"], f"{where}['weight_decay']"))

    def _slot_keys(self, group):
        return ("exp_avg",)

    def _init_state(self, p, group, st):
        """lion-pytorch's state: exp_avg, zeros (created on the param's first step)."""
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# ---- SignSGD -------------------------------------------------------------------------


class SignSGD(_EngineOptimizer):
    """SignSGD on stepcore's CPU engine: p = p*(1 - lr*wd) - lr*sign(g) (docs/numerics.md 8)."""

    _step_supports_amp_scaling = False  # GradScaler unscales (sign is unchanged) and skips
    _COUNTER = None
    _REFUSED_GROUP_KEYS = ()

    def __init__(self, params, lr=1e-3, weight_decay=0.0, *, threads=0, isa=None):
        """Creates the optimizer (no state)."""
        self._setup(params, dict(lr=lr, weight_decay=weight_decay), isa, threads)

    def _engine_name(self, group):
        return "sign_sgd"

    def _hyper(self, where, group):
        return dict(lr=_scalar(group["lr"], f"{where}['lr']"),
                    weight_decay=_scalar(group["weight_decay"], f"{where}['weight_decay']"))

    def _slot_keys(self, group):
        return ()


# ---- clip_grad_norm_ -----------------------------------------------------------------

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
    import numpy as np
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


from ._manager import GradientManager  # noqa: E402  (the managers' torch face)
