"""stepcore.torch's 8-bit drop-ins: for every optimizer whose table entry takes 8-bit state
(``stepcore.optimizer_table()``'s ``q8``), the class ``<Name>8bit`` (``AdamW8bit``,
``Adam8bit``): its f32 drop-in with block-wise 8-bit state slots (docs/numerics.md 8f) for
every param of at least ``min_8bit_size`` elements.

A param's state holds, for each slot ``k`` the configuration uses, either a tensor of the
param's dtype and shape (smaller params: the f32 drop-in's layout) or the 8-bit pair
``state[k]`` (uint8 codes, the param's shape) and ``state[k + "_absmax"]`` (float32, one
maximum per block of ``Q8_BLOCK_SIZE`` elements); the kind of a param's state is fixed when
it is created (codes 0, maxima 0, as torchao's) and kept by ``state_dict``. A torchao 8-bit
optimizer's ``state_dict`` loads directly (its state tensors' codes and scales are these
pairs), and so does a bitsandbytes 8-bit optimizer's (state1/absmax1 is the first slot,
state2/absmax2 the second), once their block size and map are checked.
"""

from __future__ import annotations

import torch

from . import _core, _table
from ._torch_checks import _check_tensor

BLOCK = _table.Q8_BLOCK_SIZE
_ABSMAX = "_absmax"  # the suffix of a slot's block maxima in a param's state


def _blocks(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK


class _Q8:
    """Mixin over an f32 drop-in: 8-bit slots for params of at least min_8bit_size."""

    _ROWS = False  # Engine.step on lists: the cached C rows read f32 slots only

    def __init__(self, params, *args, block_size=BLOCK, min_8bit_size=4096, **kwargs):
        """The f32 drop-in's arguments, plus block_size (BLOCK only) and min_8bit_size (an
        int >= 0: params with fewer elements keep the f32 drop-in's state)."""
        _table.check_q8_arguments(block_size, min_8bit_size, "stepcore.torch")
        self._q8_defaults = dict(block_size=block_size, min_8bit_size=min_8bit_size)
        for key, value in self._Q8_FORMULA.items():
            kwargs.setdefault(key, value)
        super().__init__(params, *args, **kwargs)

    def _setup(self, params, defaults, isa, threads) -> None:
        defaults.update(self._q8_defaults)
        super()._setup(params, defaults, isa, threads)

    def _new_slot(self, st, p, k, value) -> None:
        """Slot k as an 8-bit pair (codes 0, maxima 0, as torchao's) when p has at least
        min_8bit_size elements, else the f32 drop-in's slot."""
        if p.numel() < self.defaults["min_8bit_size"]:
            super()._new_slot(st, p, k, value)
            return
        if value is not None:  # no optimizer with 8-bit state starts a slot elsewhere
            raise NotImplementedError(f"stepcore.torch: 8-bit slot {k!r} starting at {value}")
        st[k] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
        st[k + _ABSMAX] = torch.zeros(_blocks(p.numel()), dtype=torch.float32, device=p.device)

    def _check_slot(self, st, k, p, name) -> None:
        """An 8-bit pair: codes of p's size, f32 maxima one per block (named as `name`)."""
        v = st[k]
        if not (isinstance(v, torch.Tensor) and v.dtype == torch.uint8):
            super()._check_slot(st, k, p, name)
            return
        _check_tensor(v, name, (torch.uint8,), numel=p.numel(), role="8-bit state")
        where = name[:-len(f"['{k}']")] + f"['{k}{_ABSMAX}']"
        if k + _ABSMAX not in st:
            raise ValueError(f"stepcore.torch: '{where}' is missing (8-bit state '{k}' keeps "
                             "its block maxima there)")
        _check_tensor(st[k + _ABSMAX], where, (torch.float32,), numel=_blocks(p.numel()),
                      role="8-bit state")

    def _slot_arg(self, st, k):
        v = st[k]
        if v.dtype == torch.uint8:
            return (v.detach(), st[k + _ABSMAX].detach())
        return v.detach()

    def load_state_dict(self, state_dict):
        """Loads this class's state_dict, its f32 drop-in's, or a torchao or bitsandbytes
        8-bit optimizer's (each state tensor with codes and a scale, each bitsandbytes
        state<k> with its absmax<k>, becomes an 8-bit pair once its block size and map are
        this class's: ValueError naming the entry otherwise)."""
        converted = dict(state_dict)
        converted["state"] = {key: self._from_torchao(key, st)
                              for key, st in state_dict["state"].items()}
        super().load_state_dict(converted)
        # torch casts a floating param's state to its dtype: 8-bit pairs stay as saved.
        saved = [i for g in converted["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for key, p in zip(saved, params):
            st = converted["state"].get(key, {})
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dtype == torch.uint8 and k + _ABSMAX in st:
                    self.state[p][k] = v.detach().cpu().contiguous().clone()
                    self.state[p][k + _ABSMAX] = \
                        st[k + _ABSMAX].detach().cpu().contiguous().clone()

    def _from_bitsandbytes(self, key, st):
        """A param's saved bitsandbytes state (state1, absmax1, qmap1, ... as its optimizers
        keep them, or packed under its state_dict's quant-state key) in this class's layout:
        state<k+1> is the table's slot k, an 8-bit one with absmax<k+1> once qmap<k+1> is
        stepcore's map. Other entries (step) are kept."""
        st = dict(st)
        st.update(st.pop("__bnb_optimizer_quant_state__", None) or {})
        if "state1" not in st:
            return st
        slots = _table.entry(self._UNIT, "stepcore.torch")["slots"]
        out = {k: v for k, v in st.items()
               if not (k[:-1] in ("state", "absmax", "qmap") and k[-1:].isdigit())}
        for j, slot in enumerate(slots):
            v = st.get(f"state{j + 1}")
            if v is None:
                continue
            where = f"state_dict['state'][{key!r}]['state{j + 1}']"
            if v.dtype != torch.uint8:
                out[slot["name"]] = v
                continue
            absmax, qmap = st.get(f"absmax{j + 1}"), st.get(f"qmap{j + 1}")
            if absmax is None or qmap is None or absmax.numel() != _blocks(v.numel()):
                raise ValueError(f"stepcore.torch: {where}: 8-bit bitsandbytes state without "
                                 f"one absmax{j + 1} per block of {BLOCK} and qmap{j + 1}")
            self._check_map(qmap, slot["non_negative"], where)
            out[slot["name"]] = v.detach().cpu().contiguous().clone()
            out[slot["name"] + _ABSMAX] = absmax.detach().cpu().float().contiguous().clone()
        return out

    @staticmethod
    def _check_map(qmap, non_negative, where) -> None:
        want = torch.tensor(_core.q8_map(non_negative), dtype=torch.float32)
        got = qmap.detach().cpu().float().reshape(-1)
        if got.numel() != 256 or not torch.equal(got.view(torch.int32), want.view(torch.int32)):
            raise ValueError(f"stepcore.torch: {where}: its code map is not stepcore's "
                             f"{'unsigned' if non_negative else 'signed'} map (stepcore.q8_map)")

    def _from_torchao(self, key, st):
        """A param's saved state with torchao's 8-bit tensors made 8-bit pairs."""
        st = self._from_bitsandbytes(key, st)
        out = {}
        for k, v in st.items():
            codes, scale, qmap = (getattr(v, a, None) for a in ("codes", "scale", "qmap"))
            if codes is None or scale is None or qmap is None:
                out[k] = v
                continue
            where = f"state_dict['state'][{key!r}][{k!r}]"
            n = codes.numel()
            if codes.dtype != torch.uint8 or scale.dtype != torch.float32 or \
                    scale.numel() != _blocks(n) or (n and n // scale.numel() != BLOCK):
                raise ValueError(f"stepcore.torch: {where}: 8-bit state with {n} codes and "
                                 f"{scale.numel()} scales is not block-wise over blocks of "
                                 f"{BLOCK}")
            self._check_map(qmap, not bool(getattr(v, "signed", True)), where)
            out[k] = codes.detach().cpu().contiguous().clone()
            out[k + _ABSMAX] = scale.detach().cpu().float().contiguous().clone()
        return out


def _formula_default(base) -> dict:
    """torchao's formula, where the optimizer has one: the 8-bit peer's bits by default."""
    return _table.q8_defaults(_table.entry(base._UNIT, "stepcore.torch"))


def eight_bit_classes(drop_ins) -> dict:
    """{optimizer name: its 8-bit class}, for every drop-in whose table entry takes 8-bit
    state; each class is named after its drop-in with "8bit" appended."""
    out = {}
    for base in drop_ins:
        if not _table.entry(base._UNIT, "stepcore.torch")["q8"]:
            continue
        name = base.__name__ + "8bit"
        doc = (f"{base.__name__} on stepcore's CPU engine with block-wise 8-bit state for params "
               f"of at least min_8bit_size elements (docs/numerics.md 8f; stepcore.torch."
               f"_torch_q8). {base.__name__}'s arguments"
               + (f", formula \"torchao\" by default (torchao's {name} bit for bit)"
                  if _formula_default(base) else "")
               + ", plus block_size and min_8bit_size.")
        out[base._UNIT] = type(name, (_Q8, base), {
            "__doc__": doc, "__module__": "stepcore.torch", "__qualname__": name,
            "_Q8_FORMULA": _formula_default(base)})
    return out
