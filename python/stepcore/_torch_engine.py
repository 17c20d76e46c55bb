"""stepcore.torch's engine owner and cached rows: the base of every drop-in optimizer.

``_EngineOwner`` holds the CPU engine (isa, threads) and the compute copies;
``_EngineOptimizer`` is a ``torch.optim.Optimizer`` whose step is one engine optimizer
(``Engine.step`` by name) per param group over cached rows, everything about the
optimizer — its hyper-parameters by name, its state slots, whether it counts steps —
read from the optimizer table (``stepcore.optimizer_table()``), so a drop-in declares only
what torch's class of the same name does differently.
"""

from __future__ import annotations

import operator

import torch

from . import _core, _table
from ._torch_checks import (_COMPUTE_DTYPES, _bump_versions, _check_grad, _check_param,
                            _check_tensor, _detached, _engine_checked, _scalar, _unsupported)


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
# DLPack C exchange API) and the compute copies, and compares every entry of the state dicts
# (the optimizer's slots, e.g. exp_avg and exp_avg_sq, its step, and any other key) by
# identity, in order, and self.state's params and dicts the same way: public dict
# iteration, no interpreter internals. When anything no longer matches it writes nothing
# and the group is checked in full again. Not detected (and not supported): swapping a
# state tensor's storage in place (state[p]['exp_avg'].data = ...). Version counters: the
# params and compute copies, which autograd may have saved, advance after every step as
# torch's in-place update does; the state tensors are the optimizer's own and their
# counters do not advance (docs/python.md).

_grad_of = operator.attrgetter("grad")
_PLANS = {}  # (drop-in class, engine optimizer) -> _EngineOptimizer._plan's tuple
_GRAD_TYPES = [torch.Tensor]  # exact types of grads the rows take (others: the full path)


class _GroupRows:
    """One group's cached rows and what the step needs beside them."""

    __slots__ = ("rows", "eparams", "states", "slots", "steps", "computes", "bump",
                 "compute_generation", "usable", "reads", "layout")


class _EngineOptimizer(_EngineOwner, torch.optim.Optimizer):
    """A torch.optim.Optimizer whose step is one engine optimizer (`Engine.step` by name)
    over cached rows. The optimizer table gives the rest: the group's hyper-parameters by
    their names (``_hyper``), the state slots its configuration uses (``_slot_keys``) and
    whether it counts steps. A subclass (a drop-in) declares:

    * ``_UNIT``: the name of the optimizer it steps (``stepcore.optimizer_table()``);
      ``_engine_name(group)`` may choose another per group (Adam's decoupled decay);
    * ``_STEP_IN_STATE``: for an optimizer that counts steps, whether torch keeps the
      counter in ``state['step']`` (a 0-dim float32 tensor), else the rows keep a private
      one, 0 exactly when the step creates the param's state, i.e. its first step (SGD);
    * ``_INIT_ALL_AT_ONCE``: torch creates a param's whole state when it is empty (Adam,
      Adagrad), else each missing slot (SGD's buffer, Lion's exp_avg);
    * ``_FROM_DEFAULTS``: hyper-parameters torch reads from the constructor's defaults, not
      from the group (Adagrad's initial_accumulator_value).
    """

    _step_supports_amp_scaling = True  # GradScaler sets self.grad_scale / self.found_inf
    _UNIT = None
    _STEP_IN_STATE = True
    _INIT_ALL_AT_ONCE = True
    _FROM_DEFAULTS = ()
    _SKIP_DROPS_CREATED = False  # found_inf == 1 removes state the step created
    _ROWS = True  # steps through cached C rows (else Engine.step on lists, checked per step)
    _REFUSED_GROUP_KEYS = ("capturable", "differentiable")  # True in a group: refused

    @property
    def _counter(self):
        """Where each param's step counter lives: "state", "private" or None (no counter)."""
        if not _table.entry(self._UNIT, "stepcore.torch")["counts_steps"]:
            return None
        return "state" if self._STEP_IN_STATE else "private"

    def _engine_name(self, group):
        """The engine optimizer that steps `group` (the table's name)."""
        return self._UNIT

    def _hyper(self, where, group):
        """The engine's hyper-parameters of a group, by the optimizer table's field names:
        beta1 and beta2 from the group's `betas` pair, the `_FROM_DEFAULTS` fields from the
        constructor's defaults, every other field the group has by its own name (numbers
        through _scalar, naming the group's key; flags as bools); a field the group lacks
        (torch has no such key) keeps the engine's default."""
        h = {}
        for key, kind, source in self._plan(self._engine_name(group)):
            if source == "group":
                if key not in group:
                    continue
                value = group[key]
            elif source == "defaults":
                value = self.defaults[key]
            else:  # betas[0] or betas[1]
                betas = group["betas"]
                if not isinstance(betas, (tuple, list)) or len(betas) != 2:
                    raise ValueError(f"stepcore.torch: {where}['betas'] must be a pair, "
                                     f"got {betas!r}")
                value = betas[source]
            if kind == "real":
                if type(value) is not float:  # the name is formatted only for a check
                    value = _scalar(value, key if source == "defaults" else
                                    f"{where}['betas'][{source}]" if source in (0, 1) else
                                    f"{where}['{key}']")
            elif kind == "flag":
                value = bool(value)
            h[key] = value
        return h

    def _plan(self, name):
        """How _hyper reads each field of the engine optimizer `name`: (field, kind, source),
        source "group" (the group's key of that name), "defaults" (_FROM_DEFAULTS) or 0/1
        (the group's betas pair), in the table's order; computed once per class."""
        plan = _PLANS.get((type(self), name))
        if plan is None:
            fields = _table.entry(name, "stepcore.torch")["hyper"]
            plan = _PLANS[(type(self), name)] = tuple(
                (f["name"], f["kind"],
                 {"beta1": 0, "beta2": 1}.get(f["name"],
                                              "defaults" if f["name"] in self._FROM_DEFAULTS
                                              else "group"))
                for f in fields)
        return plan

    def _slot_keys(self, name, h):
        """The state keys of the slots the configuration (name, h) uses, in its order."""
        return tuple(_core.optimizer_slots(name, h))

    def _init_state(self, p, st, name, h) -> None:
        """Creates p's missing state in torch's layout for the configuration (name, h): the
        step counter first (when torch keeps it), then each slot the configuration uses,
        zeros like p or filled with the value of the hyper-parameter the optimizer table
        says the slot starts from (Adagrad's sum: initial_accumulator_value)."""
        if self._INIT_ALL_AT_ONCE and st:
            return
        if self._counter == "state" and "step" not in st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        e = _table.entry(name, "stepcore.torch")
        starts = {s["name"]: s["initial"] for s in e["slots"]}
        for k in self._slot_keys(name, h):
            if k in st:
                continue
            start = starts[k]
            value = None if start is None else h[start] if start in h else \
                _table.hyper(e, start)["default"]
            self._new_slot(st, p, k, value)

    def _new_slot(self, st, p, k, value) -> None:
        """Creates slot k of p's state `st`: zeros like p, or filled with `value`."""
        if value is None:
            st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
        else:
            st[k] = torch.full_like(p, value, memory_format=torch.preserve_format)

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
                    if key == "step" and self._counter == "state":
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
        seen = self._validated.get(gi)
        if seen is None or seen[0] != name or seen[1] != h:
            # The engine validates every hyper-parameter before touching a tensor: with no
            # tensors it only validates, so a bad group is reported before any group steps.
            _engine_checked(lambda: self._engine.step(name, [], [], None, [], hyper=h), where)
            self._validated[gi] = (name, h, self._slot_keys(name, h))
        return name, h

    def _state_of(self, gi, i, p, name, h, keys, created):
        """Returns (p's state, whether this step created it): missing entries initialised as
        torch does (recorded in `created` to be removed if the step fails), then checked."""
        need = keys + (("step",) if self._counter == "state" else ())
        existed = p in self.state
        st = self.state[p]
        fresh = False
        if any(k not in st for k in need):
            before = set(st)
            self._init_state(p, st, name, h)
            added = [k for k in st if k not in before]
            created.append((p, added, existed))
            fresh = bool(added)
        name = f"state of param_groups[{gi}]['params'][{i}]"
        if self._counter == "state":
            _check_tensor(st["step"], name + "['step']", (torch.float32,), numel=1, role="step")
            t = float(st["step"])
            if not (t.is_integer() and 0 <= t < 2**24 - 1):
                raise ValueError(f"stepcore.torch: '{name}['step']' is {t}; step counters must "
                                 "be integers in [0, 2^24 - 1) (f32 counts exactly below 2^24)")
        for k in keys:
            if k not in st:
                raise ValueError(f"stepcore.torch: '{name}' has no '{k}' (a state_dict of "
                                 "another configuration?)")
            self._check_slot(st, k, p, f"{name}['{k}']")
        return st, fresh

    def _check_slot(self, st, k, p, name) -> None:
        """Raises (naming `name`) unless slot `k` of state `st` is one the engine steps."""
        _check_tensor(st[k], name, (p.dtype,), numel=p.numel())  # torch's layout

    def _slot_arg(self, st, k):
        """Slot `k` of state `st` as Engine.step takes it (detached, as DLPack requires)."""
        return st[k].detach()

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
        """Forgets every group's cached rows (state loaded, unpickled or new) and validated
        configuration."""
        self._tables = {}
        self._validated = {}  # gi -> (engine optimizer, hyper-parameters, slot keys)
        self._state_seen = None

    def _state_unchanged(self) -> bool:
        """Returns whether self.state is the dict of last step mapping the same params to
        the same dicts, in the same order (every entry compared by identity, in C)."""
        seen, s = self._state_seen, self.state
        return seen is not None and seen[0] is s and _core._same_items(s, seen[1], seen[2])

    def _cached_table(self, gi, keys):
        """Returns the group's cached rows when their layout and computes are current."""
        c = self._tables.get(gi)
        if c is None or c.rows is None or c.compute_generation != self._compute.generation \
                or c.layout != keys:
            return None
        return c

    def _new_table(self, gi, group, name, h, keys, created):
        """Checks the group in full and caches its rows."""
        self._tables.pop(gi, None)
        entries = self._group_params_with_grads(gi, group)
        stateful = bool(keys) or self._counter == "state"
        states, fresh = [], []
        for i, p, _ in entries:
            if stateful:
                st, f = self._state_of(gi, i, p, name, h, keys, created)
            else:
                st, f = {}, False  # torch keeps no state here: the rows read none
            states.append(st)
            fresh.append(f)
        computes = self._computes_of(gi, entries)
        c = _GroupRows()
        c.layout = keys
        c.eparams = [p for _, p, _ in entries]
        c.states = states
        c.slots = [[self._slot_arg(st, k) for st in states] for k in keys]
        if self._counter == "state":
            c.steps = [st["step"] for st in states]
        elif self._counter == "private":
            c.steps = [torch.zeros((), dtype=torch.float32) if f else torch.ones(())
                       for f in fresh]
        else:
            c.steps = None
        c.computes = computes
        c.compute_generation = self._compute.generation
        c.bump = c.eparams + [x for x in (computes or []) if x is not None]
        c.rows = _core._OptimizerRows(
            list(group["params"]), [i for i, _, _ in entries], states, list(keys),
            "step" if self._counter == "state" else None,
            c.steps if self._counter == "private" else None, computes,
            _GRAD_TYPES) if self._ROWS else None
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
                keys = self._validated[gi][2]
                c = self._cached_table(gi, keys)
                if c is None or not self._prepare(c, group, scale_t):
                    c = self._new_table(gi, group, name, h, keys, created)
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
            self._state_seen = (s, list(s.keys()), list(s.values()))

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
            if inf_t is not None and float(inf_t) != 0.0 and self._counter == "state":
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
        if c.rows is None:
            return False  # Engine.step on lists, the group checked in full (_new_table)
        return c.rows.prepare(group["params"], c.reads)

    def _run_lists(self, c, name, h) -> None:
        """The step through Engine.step on detached tensors (no cached rows)."""
        grads = c.reads if c.reads is not None else list(map(_grad_of, c.eparams))
        self._engine.step(name, _detached(c.eparams), c.slots,
                          None if c.steps is None else _detached(c.steps), _detached(grads),
                          c.computes, hyper=h)
