"""stepcore.torch.GradientManager: the gradient managers behind one ``offload`` setting.

A ``torch.optim.Optimizer`` (so LR schedulers drive its ``param_groups``) that owns a
``stepcore._core.GradientManager``: post-accumulate-grad hooks hand each finished gradient
(the local shard of a DTensor, a plain tensor otherwise) to the manager as the framework's
own buffer, the manager accumulates, scales, computes the exact global norm, clips and
steps in the mode's place (GPU-resident, host-resident optimizer state, or full offload),
and writes the compute weights straight into the model's parameter storage. Every mode
gives the same bits (docs/managers.md) for every optimizer of ``stepcore.optimizer_table()``,
whose roles say which hyper-parameters are each param group's and which the manager's;
see docs/python.md, "GradientManager".
"""

from __future__ import annotations

import math
import os

import torch

from . import _core, _table

__all__ = ["GradientManager"]

OFFLOAD_MODES = ("none", "optimizer", "full")
# Whose a hyper-parameter is, by its role in the optimizer table: "schedule" (lr,
# weight_decay) and "betas" (the Adam family's beta1, beta2, eps) fields are each param
# group's; "fixed" and "machine" fields are the manager's, one value for every group.
_GROUP_ROLES = ("schedule", "betas")
# The constructor arguments that set fields of whichever role: betas -> beta1 and beta2.
_ARGUMENT_FIELDS = {"betas": ("beta1", "beta2"), "eps": ("eps",), "formula": ("formula",)}
_DTYPE_NAME = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_REDUCE_OPS = None  # name -> torch.distributed.ReduceOp, filled on first use
_ABSMAX = "_absmax"  # an 8-bit slot's block maxima: the slot's name + this

try:  # DTensor lives in torch.distributed, which some builds lack.
    from torch.distributed.tensor import DTensor as _DTensor
    from torch.distributed.tensor import Replicate as _Replicate
except Exception:  # pragma: no cover - torch without distributed
    _DTensor = None
    _Replicate = None


def _is_dtensor(t) -> bool:
    """Returns whether `t` is a DTensor."""
    return _DTensor is not None and isinstance(t, _DTensor)


def _local(t):
    """Returns the local tensor of a DTensor (this rank's shard), else `t`, detached."""
    return (t.to_local() if _is_dtensor(t) else t).detach()


def _check_choice(name: str, value, allowed, extra: str = "") -> None:
    """Raises ValueError naming `name` and listing `allowed` unless value is one of them."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"stepcore.torch: '{name}' must be one of "
                         + ", ".join(repr(a) for a in allowed) + f"; got {value!r}{extra}")


def _reduce_ops():
    """Returns {op name: torch.distributed.ReduceOp} for the callbacks' ops."""
    import torch.distributed as dist

    global _REDUCE_OPS
    if _REDUCE_OPS is None:
        _REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                       "min": dist.ReduceOp.MIN}
    return _REDUCE_OPS


def _group_backends(group) -> dict:
    """Returns {device type: backend name} of `group`: 'cpu:gloo,cuda:nccl' gives
    {'cpu': 'gloo', 'cuda': 'nccl'}; a plain backend name the device types it serves."""
    import torch.distributed as dist

    try:
        config = str(dist.get_backend_config(group))
    except Exception:  # a group torch keeps no configuration for
        config = str(dist.get_backend(group))
    out = {}
    for part in config.split(","):
        device, sep, name = part.strip().partition(":")
        if sep:
            out[device] = name
    if not out:
        name = config.strip().lower()
        capability = getattr(dist.Backend, "backend_capability", {})
        out = {d: name for d in capability.get(name, ["cpu"])}
    return out


def _reducer(group, memory, stage_device=None):
    """Returns reduce(tensor, op): torch.distributed.all_reduce over `group`, in place, of a
    tensor in `memory` (a torch.device: 'cpu' or a CUDA device), on the group's backend for
    that device type. Host memory of a group without a CPU backend (NCCL alone) is staged
    through a GPU (`stage_device`, else the current one): copied there, all-reduced, copied
    back, the host waiting. Raises ValueError naming 'process_group' when the group cannot
    reduce that memory."""
    import torch.distributed as dist

    ops = _reduce_ops()
    backends = _group_backends(group)
    shown = ",".join(f"{d}:{b}" for d, b in backends.items())

    def direct(t, op):
        dist.all_reduce(t, op=ops[op], group=group)

    if memory.type in backends:
        return direct
    if memory.type == "cuda":
        raise ValueError(
            f"stepcore.torch: 'process_group' (backends {shown}) has no CUDA backend, but modes "
            "none and optimizer all-reduce the norm in the parameters' CUDA memory: use a "
            "group with one (nccl, or 'cpu:gloo,cuda:nccl'), or offload='full'")
    if memory.type == "cpu" and "cuda" in backends and torch.cuda.is_available():
        stage = stage_device or torch.device("cuda", torch.cuda.current_device())

        def staged(t, op):
            on_gpu = t.to(stage)
            dist.all_reduce(on_gpu, op=ops[op], group=group)
            t.copy_(on_gpu)  # waits for the collective: host memory is reduced on return

        return staged
    raise ValueError(
        f"stepcore.torch: 'process_group' (backends {shown}) cannot all-reduce {memory.type} "
        "memory: the host's norm words need a CPU backend (gloo), or a CUDA backend and a GPU "
        "to stage them through")


def _all_reduce_function(group, stage_device=None):
    """Returns all_reduce(array, op) over `group` of a host communicator's numpy words (in
    place): on the group's CPU backend, else staged through the GPU (see _reducer)."""
    reduce = _reducer(group, torch.device("cpu"), stage_device)

    def all_reduce(array, op):
        reduce(torch.from_numpy(array), op)

    return all_reduce


# The signed view of an unsigned word type, and the top bit that flipped orders the
# unsigned words as the signed view (torch.distributed has no unsigned MAX/MIN).
_SIGNED = {getattr(torch, f"uint{n}"): (getattr(torch, f"int{n}"), -(1 << (n - 1)))
           for n in (32, 64) if hasattr(torch, f"uint{n}")}


def _device_all_reduce_function(group, memory, stream):
    """Returns all_reduce(array, op) of a device-memory communicator (docstring of
    _core.make_device_callback_communicator): the manager's words themselves, as a tensor
    in `memory`, all-reduced over `group` in place; on a CUDA device under
    torch.cuda.stream(`stream`), the manager's compute stream, so the collective is ordered
    with the kernels that write and read the words and nothing waits on the host. Unsigned
    words are reduced as their signed view: SUM gives the same bits; MAX/MIN flip the top
    bit before and after (exact, as the host communicator's words)."""
    import contextlib

    reduce = _reducer(group, memory)

    def all_reduce(array, op):
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            t = torch.from_dlpack(array)
            signed, top = _SIGNED.get(t.dtype, (None, 0))
            if signed is not None:
                t = t.view(signed)
            if op != "sum" and top:
                t.bitwise_xor_(top)
            reduce(t, op)
            if op != "sum" and top:
                t.bitwise_xor_(top)

    return all_reduce


def _default_threads(local_world_size: int) -> int:
    """The optimizer threads of one rank: its share of the CPUs it may run on."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        allowed = os.cpu_count() or 1
    return max(1, min(allowed, (os.cpu_count() or 1) // max(1, local_world_size)))


def _local_gpu_buses(local_world_size):
    """PCI bus ids of local ranks' GPUs (rank i drives cuda:i), or None when unknown."""
    try:
        out = []
        for i in range(local_world_size):
            props = torch.cuda.get_device_properties(i)
            out.append(f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:"
                       f"{props.pci_device_id:02x}.0")
        return out
    except Exception:  # fewer GPUs than local ranks, or a torch without the fields
        return None


class GradientManager(torch.optim.Optimizer):
    """The step after backward in one of three places, chosen by ``offload``."""

    def __init__(self, params, *, offload, optimizer="adamw", lr=1e-3, betas=None, eps=None,
                 weight_decay=0.0, formula=None, hyper=None,
                 chunk_elements=16 << 20,
                 process_group=None, threads=None, isa=None, numa=True, recorder=None,
                 speculation="auto", speculation_bytes=-1, speculation_device_bytes=0,
                 ring_slots=-1, ring_slot_elements=1 << 19, block_size=_table.Q8_BLOCK_SIZE,
                 min_8bit_size=4096):
        """Builds the manager over a module or parameters (see docs/python.md)."""
        extra = " (the 'fsdp' mode was removed; 'full' covers it)" if offload == "fsdp" else ""
        _check_choice("offload", offload, OFFLOAD_MODES, extra)
        # "adamw8bit": AdamW with block-wise 8-bit state (params of at least min_8bit_size
        # elements); its formula defaults to torchao's, as stepcore.torch.AdamW8bit's.
        self._info, self._q8 = _table.entry_q8(optimizer, "stepcore.torch")
        _table.check_q8_arguments(block_size, min_8bit_size, "stepcore.torch")
        self._min_8bit_size = min_8bit_size
        if self._q8 and formula is None and "formula" not in (hyper or {}):
            formula = _table.q8_defaults(self._info).get("formula")
        self._config, defaults = self._resolve_hyper(
            hyper, dict(betas=betas, eps=eps, formula=formula), lr, weight_decay)
        _check_choice("speculation", speculation, ("always", "never", "auto"))
        for name, value in (("speculation_bytes", speculation_bytes),
                            ("speculation_device_bytes", speculation_device_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < -1:
                raise ValueError(f"stepcore.torch: '{name}' must be an int >= 0, or -1 "
                                 f"(as much as every chunk needs); got {value!r}")
        if speculation_device_bytes != 0 and offload != "full":
            raise ValueError("stepcore.torch: 'speculation_device_bytes' stages compute "
                             "weights only with offload='full'; got "
                             f"{speculation_device_bytes!r} with offload={offload!r}")
        for name, value, low in (("ring_slots", ring_slots, -1),
                                 ("ring_slot_elements", ring_slot_elements, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"stepcore.torch: '{name}' must be an int >= {max(low, 1)}"
                                 + (", or -1 (the default ring)" if low < 0 else "")
                                 + f"; got {value!r}")
        if ring_slots == 0:
            raise ValueError("stepcore.torch: 'ring_slots' must be an int >= 1, or -1 (the "
                             "default ring); got 0")
        self._ring = (ring_slots, ring_slot_elements)
        self._speculation = (speculation, speculation_bytes, speculation_device_bytes)
        names = None
        if isinstance(params, torch.nn.Module):
            named = list(params.named_parameters())
            names = {id(p): n for n, p in named}
            params = [p for _, p in named]
        self._built = False
        super().__init__(params, defaults)
        self.offload = offload
        self.optimizer_name = optimizer
        flat = [p for g in self.param_groups for p in g["params"]]
        if not flat:
            raise ValueError("stepcore.torch: 'params' is empty")
        self._params = flat
        self._names = [names.get(id(p), f"param{i}") if names else f"param{i}"
                       for i, p in enumerate(flat)]
        self._index = {id(p): i for i, p in enumerate(flat)}
        self._recorder = None
        self._clip_called = False
        if recorder is not None:
            from .diff import Recorder

            if not isinstance(recorder, Recorder):
                raise TypeError("stepcore.torch: 'recorder' must be a stepcore.diff.Recorder "
                                f"or None, got {type(recorder).__name__}")
        self._build(chunk_elements, process_group, threads, isa, numa)
        self._built = True
        if recorder is not None:
            recorder._set_run(device=str(self.device), offload=offload,
                              formula=self._config.get("formula"),
                              optimizer=optimizer, threads=self.threads)
            self._recorder = recorder

    # ---- construction --------------------------------------------------------------

    def _resolve_hyper(self, hyper, arguments, lr, weight_decay):
        """Returns (every manager-wide field's value, the param groups' defaults), by the
        optimizer table's roles: `hyper` sets fields by name but not a group's (role
        schedule or betas); `arguments` (betas, eps, formula; None: unset) set the fields
        they name, of either role, and are refused for an optimizer without them; a field
        set twice is refused. Unset fields take the table's defaults. The groups' defaults
        hold lr, weight_decay, and betas and eps where the optimizer has them."""
        info = self._info
        fields = {h["name"]: h for h in info["hyper"]}
        if hyper is not None and not isinstance(hyper, dict):
            raise TypeError(f"stepcore.torch: 'hyper' must be a dict or None, got "
                            f"{type(hyper).__name__}")
        hyper = dict(hyper or {})
        for key in hyper:
            if key in fields and fields[key]["role"] in _GROUP_ROLES:
                raise ValueError(f"stepcore.torch: 'hyper' sets {key!r}, a param group's "
                                 f"value: pass it as an argument or in the param groups")
        values = {}
        for arg, value in arguments.items():
            if value is None:
                continue
            keys = _ARGUMENT_FIELDS[arg]
            if any(k not in fields for k in keys):
                raise ValueError(
                    f"stepcore.torch: '{arg}' is not a hyper-parameter of optimizer "
                    f"{info['name']!r} (its hyper-parameters: "
                    + ", ".join(fields) + f"); got {value!r}")
            if arg == "betas":
                if not isinstance(value, (tuple, list)) or len(value) != 2:
                    raise ValueError(f"stepcore.torch: 'betas' must be a pair, got {value!r}")
                value = (float(value[0]), float(value[1]))
            for k, v in zip(keys, value if arg == "betas" else (value,)):
                if k in hyper:
                    raise ValueError(f"stepcore.torch: {k!r} is set twice: by '{arg}' and "
                                     "by 'hyper'")
                values[k] = v
        config, resolved = {}, {}
        for name, h in fields.items():
            resolved[name] = hyper.get(name, values.get(name, h["default"]))
            if h["role"] not in _GROUP_ROLES:
                config[name] = resolved[name]
        defaults = dict(lr=lr, weight_decay=weight_decay)
        for arg in ("betas", "eps"):  # the groups show them whatever their role
            keys = _ARGUMENT_FIELDS[arg]
            if all(k in fields for k in keys):
                value = tuple(resolved[k] for k in keys)
                defaults[arg] = value if arg == "betas" else value[0]
        for name in list(hyper):
            if name not in fields:  # the extension names it, with the optimizer's fields
                config[name] = hyper[name]
        return config, defaults

    def _group_entry(self, gi, g) -> dict:
        """The C++ manager's entry of param group gi: its name, lr and weight decay, and
        its betas and eps where their role is the groups'; refuses a group that sets a
        manager-wide (role fixed) beta or eps to another value than the manager's."""
        entry = dict(name=str(g.get("name", f"group{gi}")), lr=float(g["lr"]),
                     weight_decay=float(g["weight_decay"]))
        roles = {h["name"]: h["role"] for h in self._info["hyper"]}
        for key, fields in (("betas", ("beta1", "beta2")), ("eps", ("eps",))):
            if fields[0] not in roles:
                continue
            value = g[key]
            if key == "betas" and (not isinstance(value, (tuple, list)) or len(value) != 2):
                raise ValueError(f"stepcore.torch: param_groups[{gi}]['betas'] must be a pair")
            value = tuple(float(v) for v in value) if key == "betas" else (float(value),)
            if roles[fields[0]] in _GROUP_ROLES:
                entry.update(zip(fields, value))
            elif value != tuple(float(self._config[f]) for f in fields):
                mine = tuple(self._config[f] for f in fields)
                raise ValueError(
                    f"stepcore.torch: param_groups[{gi}]['{key}'] is "
                    f"{value if key == 'betas' else value[0]!r}, but {self._info['name']}'s "
                    f"{key} are the optimizer's, one value for every group (role fixed): "
                    f"{mine if key == 'betas' else mine[0]!r}; set it with the '{key}' "
                    "argument")
        return entry

    def _build(self, chunk_elements, process_group, threads, isa, numa) -> None:
        """Checks the parameters and creates the C++ manager, its hooks and masters."""
        locals_ = []
        for i, p in enumerate(self._params):
            name = f"params[{i}] ({self._names[i]})"
            if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                raise TypeError(f"stepcore.torch: {name} must be a floating-point tensor")
            local = _local(p)
            if local.dtype not in _DTYPE_NAME:
                raise TypeError(f"stepcore.torch: {name} has dtype {local.dtype}; expected "
                                "float32, bfloat16 or float16")
            if not local.is_contiguous():
                raise ValueError(f"stepcore.torch: {name} must be contiguous (its storage "
                                 "receives the compute weights)")
            if not p.requires_grad:
                raise ValueError(f"stepcore.torch: {name} does not require grad")
            locals_.append(local)
        devices = {t.device for t in locals_}
        if len(devices) != 1:
            raise ValueError("stepcore.torch: every parameter must be on one device, got "
                             + ", ".join(sorted(str(d) for d in devices)))
        dev = devices.pop()
        stream = None
        if dev.type == "cpu":
            device = "host"
        elif dev.type == "cuda":
            device = f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
            stream = torch.cuda.current_stream(dev).cuda_stream
        else:
            raise NotImplementedError(f"stepcore.torch: parameters on '{dev}' are not supported")
        self.device = dev

        group, counts = self._process_group(process_group)
        comm = None
        if group is not None:
            import torch.distributed as dist

            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
            if self.rank < 0:
                raise ValueError("stepcore.torch: this process is not a member of "
                                 "'process_group'")
            comm = self._communicator(group, dev, device)
        else:
            self.rank, self.world_size = 0, 1
        self._comm = comm

        groups = [self._group_entry(gi, g) for gi, g in enumerate(self.param_groups)]
        group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        specs = []
        for i, (p, local) in enumerate(zip(self._params, locals_)):
            dt = _DTYPE_NAME[local.dtype]
            specs.append(dict(name=self._names[i], numel=local.numel(), grad_dtype=dt,
                              compute_dtype=dt, has_compute_weights=True,
                              counts_toward_norm=counts(p), group=group_of[i],
                              gradient_buffer=False, compute_into=local))

        local_rank = _core.local_rank_from_env(0)
        local_world = _core.local_world_size_from_env(1)
        cpus, numa_node = [], -1
        if threads is None:
            threads = _default_threads(local_world)
        place = None
        if numa and self.offload != "none":
            if device == "host":
                place = _core.numa_place_on_node(0, local_rank, local_world)
            else:  # the GPU's node: every local rank's GPU by its PCI bus id
                buses = _local_gpu_buses(local_world)
                if buses is not None and local_rank < len(buses):
                    place = _core.numa_placement(buses, local_rank)
            if place is not None and place["bound"]:
                cpus, numa_node = list(place["cpus"]), int(place["numa_node"])
                threads = min(int(threads), len(cpus)) if cpus else int(threads)
        self.threads = int(threads)
        self._m = _core.GradientManager(
            self.offload, specs, optimizer=self._info["name"], groups=groups,
            hyper=self._config,
            chunk_elements=int(chunk_elements), device=device, comm=comm,
            threads=self.threads, isa=isa, cpus=cpus, numa_node=numa_node, stream=stream,
            speculation=self._speculation[0], speculation_bytes=self._speculation[1],
            speculation_device_bytes=self._speculation[2],
            ring_slots=self._ring[0], ring_slot_elements=self._ring[1],
            q8_state=self._q8, min_8bit_size=self._min_8bit_size)
        self._locals = locals_
        for i, local in enumerate(locals_):  # masters start from the model's values
            self._m.load_parameter(i, local.float().contiguous().cpu())
        self._pushed = [(g["lr"], g["weight_decay"]) for g in groups]
        self._cuda = dev.type == "cuda"
        self._pending = {}  # i -> (the grad handed over, the stream it was written on)
        self._held = []  # (release event, grad): host-device grads whose release is pending
        self._overlap = False
        self._in_backward = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                       for i, p in enumerate(self._params)]

    def _communicator(self, group, dev, device):
        """The communicator of the norm over `group` (None for one rank, after the same
        checks): mode full reduces host memory (a host communicator: the group's CPU
        backend, else staged through `dev`); modes none and optimizer reduce the device's
        memory in place (CUDA memory on the compute stream, host memory on the host device).
        Raises ValueError naming 'process_group' when the group cannot reduce that memory."""
        cuda = dev.type == "cuda"
        stream = torch.cuda.current_stream(dev) if cuda else None
        full = self.offload == "full"
        fn = (_all_reduce_function(group, dev if cuda else None) if full
              else _device_all_reduce_function(group, dev, stream))
        if self.world_size == 1:
            return None
        if full:
            return _core.make_callback_communicator(self.rank, self.world_size, fn)
        return _core.make_device_callback_communicator(
            self.rank, self.world_size, fn, device=device,
            stream=None if stream is None else stream.cuda_stream)

    def _process_group(self, process_group):
        """Returns (the group the norm is global over or None, counts_toward_norm(p))."""
        meshes = []  # distinct meshes (fully_shard makes equal mesh objects per module)
        for p in self._params:
            if _is_dtensor(p) and not any(p.device_mesh == m for m in meshes):
                meshes.append(p.device_mesh)

        def counts(p):
            if not _is_dtensor(p):
                return True
            # A replicated mesh dimension holds the same shard on every coordinate: the norm
            # counts the copy of coordinate 0 only.
            coord = p.device_mesh.get_coordinate() or []
            return all(c == 0 for c, pl in zip(coord, p.placements) if isinstance(pl, _Replicate))

        if process_group is not None:
            import torch.distributed as dist

            if process_group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", None):
                raise ValueError("stepcore.torch: this process is not a member of "
                                 "'process_group' (new_group gave it NON_GROUP_MEMBER)")
            if not isinstance(process_group, dist.ProcessGroup):
                raise TypeError("stepcore.torch: 'process_group' must be a "
                                "torch.distributed.ProcessGroup or None, got "
                                f"{type(process_group).__name__}")
            return process_group, counts
        if meshes:
            import torch.distributed as dist

            if len(meshes) > 1:
                raise ValueError("stepcore.torch: DTensor parameters on several device meshes; "
                                 "pass 'process_group' (the group the norm is global over)")
            mesh = meshes[0]
            return (mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD), counts
        return None, counts

    def add_param_group(self, param_group) -> None:
        """Groups are fixed once the manager is built (its layout is fixed)."""
        if getattr(self, "_built", False):
            raise NotImplementedError("stepcore.torch: GradientManager cannot add parameter "
                                      "groups after construction (the manager's layout is fixed)")
        super().add_param_group(param_group)

    # ---- the step ------------------------------------------------------------------

    def _current_stream(self):
        """The stream backward writes on now (torch's current CUDA stream, as an address),
        or None on the host device (its writers have no stream)."""
        return torch.cuda.current_stream(self.device).cuda_stream if self._cuda else None

    def _written_event(self, stream):
        """The event of the gradient's write: recorded on `stream` (from the device's pool
        of events), or None on the host device, whose writer (this thread) is done."""
        return self._m.record_on(stream) if stream is not None else None

    def _hook(self, i):
        """Returns parameter i's post-accumulate-grad hook."""
        def hook(p):
            g = p.grad
            if g is None:
                return
            local = _local(g)
            stream = self._current_stream()
            try:
                # The manager's reads wait for the write on the device (not on the host),
                # whichever stream backward runs on.
                self._m.gradient_ready(i, local, self._written_event(stream))
            except (ValueError, TypeError, RuntimeError, NotImplementedError) as e:
                raise type(e)(f"stepcore.torch: the gradient of params[{i}] "
                              f"({self._names[i]}): {e}") from e
            self._pending[i] = (g, stream)  # the manager reads it until gradient_released
            p.grad = None
        return hook

    def _release_gradients(self) -> None:
        """Gives back the grads handed over, ordered by their release events, without a
        host wait: a CUDA grad's stream waits for the manager's reads (its allocator reuses
        the memory only after them); a host-device grad whose reads are still queued is
        kept until its event is complete (checked here and after every step)."""
        for i, (g, stream) in self._pending.items():
            released = self._m.gradient_released(i)
            if stream is not None:
                self._m.wait_on(stream, released)
            elif not released.complete():
                self._held.append((released, g))
        self._pending.clear()
        self._held = [(e, g) for e, g in self._held if not e.complete()]

    def _push_hyperparameters(self) -> None:
        """Hands each group's lr and weight decay (a scheduler's values) to the manager."""
        for gi, g in enumerate(self.param_groups):
            now = (float(g["lr"]), float(g["weight_decay"]))
            if now != self._pushed[gi]:
                self._m.set_hyperparameters(gi, *now)
                self._pushed[gi] = now

    def begin_step(self, gradient_scale, overlap_optimizer=False) -> None:
        """Starts a step whose gradients are multiplied by `gradient_scale` (e.g. 1/tokens);
        `overlap_optimizer`: step each chunk speculatively during the final backward (the
        step's decision commits or rolls it back: the same bits; docs/python.md)."""
        self._push_hyperparameters()
        self._m.begin_step(float(gradient_scale), bool(overlap_optimizer))
        self._overlap = bool(overlap_optimizer)
        self._clip_called = False

    def begin_backward(self, final_backward) -> None:
        """Starts a micro-batch's backward (`final_backward`: the step's last)."""
        self._m.begin_backward(bool(final_backward))
        self._in_backward = True

    def finish_backward(self) -> None:
        """Ends the micro-batch's backward; the grads handed over are released (those the
        step reads again, in a full-offload step of one micro-batch, after step())."""
        self._m.finish_backward()
        self._in_backward = False
        if not self._m.gradients_read_by_step:
            self._release_gradients()

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """Returns the global norm before clipping (0-dim f32) and clips by it (with or
        without overlap: speculated chunks are then committed or rolled back exactly)."""
        if float(norm_type) != 2.0:
            raise ValueError(f"stepcore.torch: 'norm_type' must be 2 (got {norm_type!r}); the "
                             "managers compute the L2 norm")
        norm = self._m.clip_grad_norm(float(max_norm))
        self._clip_called = True
        return torch.tensor(norm, dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        """Runs the optimizer and waits for it (with overlap: commits the speculated chunks
        or rolls them back and steps them again, and steps the chunks that waited)."""
        if closure is not None:
            raise NotImplementedError("stepcore.torch: GradientManager.step takes no closure "
                                      "(backward runs between begin_backward and finish_backward)")
        if not self._overlap:
            self._push_hyperparameters()
        self._m.step()
        self._report = self._m.report()
        self._release_gradients()  # any the step read again
        self._held = [(e, g) for e, g in self._held if not e.complete()]
        torch.autograd.graph.increment_version(self._locals)
        if self._recorder is not None:
            self._record_step()
        return None

    def _record_step(self) -> None:
        """Copies the step's norm, clip coefficient and state into the recorder; ends its step."""
        # Point "clip" (only when clip_grad_norm_ was called), then "after_step": exp_avg,
        # exp_avg_sq, step, master and param of every parameter, kind by kind.
        rec = self._recorder
        if self._clip_called:
            rec.record("clip", "norm", torch.tensor(self._report["norm"], dtype=torch.float32))
            rec.record("clip", "clip_coefficient",
                       torch.tensor(self._report["clip_coefficient"], dtype=torch.float32))
        # An 8-bit slot records its codes under the slot's name and its block maxima under
        # the name + "_absmax" (those params only).
        slots = self._m.state_slot_names
        state = [self._state_entry(i) for i in range(len(self._params))]
        kinds = ([k for n in slots for k in (n, n + _ABSMAX)]
                 + (["step"] if self._m.counts_steps else []) + ["master", "param"])
        for kind in kinds:
            for i, name in enumerate(self._names):
                if kind == "param":
                    t = self._locals[i]  # the compute weights, in the model's storage
                elif kind not in state[i]:
                    continue
                else:
                    t = state[i][kind]
                rec.record("after_step", f"{kind}/{name}", t)
        rec._manager_step_done()

    def report(self) -> dict:
        """The last step's report: stepped, skipped, norm, finite, clip_coefficient, and for
        overlapped steps chunks_speculated, chunks_committed, chunks_rolled_back;
        exposed_seconds (the step's time after its last gradient), staging_wait_seconds
        (full offload: backward's wait for a free staging slot); and memory, every byte the
        manager holds by kind now and at its peak (docs/managers.md, "Memory")."""
        r = dict(self._report)
        r["memory"] = self._m.memory()
        return r

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The hooks already released every gradient; clears any left on the params."""
        for p in self._params:
            p.grad = None

    def close(self) -> None:
        """Waits for outstanding work, removes the hooks and frees the manager."""
        for h in getattr(self, "_hooks", []):
            h.remove()
        self._hooks = []
        if hasattr(self, "_m"):
            self._m.close()
        self._pending = {}
        self._held = []  # close() waited for the manager's reads

    # ---- state -----------------------------------------------------------------------

    def state_dict(self):
        """torch's layout: state[i] = {the optimizer's slots by name (stepcore.optimizer_table():
        exp_avg, exp_avg_sq, ...), step when it counts steps, master}, plus param_groups.

        Modes optimizer and full return views of the manager's host state (no copy; valid
        until the next begin_step, load or close); mode none copies. DTensor parameters get
        DTensor state with their placements, so a distributed checkpoint saves the shards.
        """
        state = {i: self._state_entry(i, shaped=True) for i in range(len(self._params))}
        groups = []
        start = 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(d)
        return {"state": state, "param_groups": groups}

    def _state_entry(self, i, shaped=False) -> dict:
        """Parameter i's state as torch's layout names it: master, the slots by name (an
        8-bit one: uint8 codes of the param's shape, and float32 block maxima under the
        name + "_absmax", as stepcore.torch.AdamW8bit keeps them), step when it counts
        steps. `shaped`: DTensors for DTensor params."""
        master, named = self._host_state(i)
        shape = self._locals[i].shape
        view = (lambda t: self._shaped(i, t)) if shaped else (lambda t: t.view(shape))
        entry = {"master": view(torch.from_dlpack(master))}
        for name in self._m.state_slot_names:  # torch's names: exp_avg, momentum_buffer, sum
            value = named[name]
            if isinstance(value, tuple):
                entry[name] = view(torch.from_dlpack(value[0]))
                entry[name + _ABSMAX] = torch.from_dlpack(value[1])
            else:
                entry[name] = view(torch.from_dlpack(value))
        if self._m.counts_steps:
            entry["step"] = torch.tensor(self._m.step_count(i), dtype=torch.float32)
        return entry

    def _q8_zeros(self, name, n):
        """An 8-bit slot `name` of n elements holding 0 (docs/numerics.md 8f): every code
        the one whose map value is +0, every block maximum 0."""
        slot = next(s for s in self._info["slots"] if s["name"] == name)
        values = [float(v) for v in _core.q8_map(slot["non_negative"])]
        zero = next(c for c, v in enumerate(values) if v == 0.0 and math.copysign(1.0, v) > 0)
        blocks = (n + _table.Q8_BLOCK_SIZE - 1) // _table.Q8_BLOCK_SIZE
        return (torch.full((n,), zero, dtype=torch.uint8), torch.zeros(blocks))

    def _host_state(self, i):
        """Parameter i's (master, {slot: array}): views in modes optimizer and full, copies
        in mode none."""
        master, named = self._m.host_state(i)
        if master is None:
            master, named, _ = self._m.read_parameter(i)
        return master, named

    def _shaped(self, i, flat):
        """Returns parameter i's flat state as its local shape (a DTensor for DTensor params)."""
        p = self._params[i]
        t = flat.view(self._locals[i].shape)
        if _is_dtensor(p):
            return _DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
        return t

    def load_state_dict(self, state_dict) -> None:
        """Loads a state_dict of this manager in any mode (or torch.optim.AdamW's layout)."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(f"stepcore.torch: the state_dict has {len(groups)} param groups, "
                             f"this manager {len(self.param_groups)}")
        state = state_dict["state"]
        starts = {s["name"]: s["initial"] for s in self._info["slots"]}
        rows = []
        for i, p in enumerate(self._params):
            st = state.get(i, {})
            master = st.get("master", p)
            def flat(t):
                t = _local(t) if isinstance(t, torch.Tensor) else torch.as_tensor(t)
                return t.detach().float().contiguous().cpu().reshape(-1)
            master = flat(master)
            # A slot the state lacks (a fresh torch optimizer's) starts where the
            # optimizer starts it: the field the table names (Adagrad's sum:
            # initial_accumulator_value), else 0.
            slots = {}
            for name in self._m.state_slot_names:
                value = st.get(name)
                if isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
                    if name + _ABSMAX not in st:  # an 8-bit slot: codes and block maxima
                        raise ValueError(f"stepcore.torch: state_dict['state'][{i}] has 8-bit "
                                         f"{name!r} without {name + _ABSMAX!r}")
                    slots[name] = (_local(value).contiguous().cpu().reshape(-1),
                                   flat(st[name + _ABSMAX]))
                elif name in st:
                    slots[name] = flat(st[name])
                else:
                    field = starts[name]
                    start = 0.0 if field is None else float(self._config[field])
                    slots[name] = torch.full_like(master, start)
                    if self._m.q8_parameter(i):  # 0 in 8 bits: the code of +0, maxima 0
                        slots[name] = self._q8_zeros(name, master.numel())
            step = float(st.get("step", 0.0)) if self._m.counts_steps else 0.0
            rows.append((master, slots, step))
        for i, (master, slots, step) in enumerate(rows):
            self._m.import_parameter(i, master, slots, step)
        for gi, (g, saved) in enumerate(zip(self.param_groups, groups)):
            for key in ("lr", "weight_decay"):
                if key in saved:
                    g[key] = saved[key]
        self._push_hyperparameters()
        torch.autograd.graph.increment_version(self._locals)
