"""The optimizer table as the Python layer reads it: ``stepcore.optimizer_table()`` (the
extension's, built from the C++ optimizer units), read once. Every Python list of
optimizers, hyper-parameters, roles and slots derives from it; none is written here.
No torch.
"""

from __future__ import annotations

from . import _core

TABLE = tuple(_core.optimizer_table())
NAMES = tuple(e["name"] for e in TABLE)
_BY_NAME = {e["name"]: e for e in TABLE}


def entry(name, where: str) -> dict:
    """Returns the table entry of the optimizer named exactly `name`, or raises ValueError
    from `where` (e.g. "stepcore.torch") naming 'optimizer' and listing the table's names."""
    e = _BY_NAME.get(name) if isinstance(name, str) else None
    if e is None:
        raise ValueError(f"{where}: 'optimizer' must be one of "
                         + ", ".join(repr(n) for n in NAMES) + f"; got {name!r}")
    return e


def choices(e: dict, name: str) -> tuple:
    """The names formula hyper-parameter `name` of entry `e` takes (the table's 'choices')."""
    return tuple(hyper(e, name)["choices"])


def hyper(e: dict, name: str):
    """Returns the hyper-parameter `name` of entry `e` (its dict), or None."""
    for h in e["hyper"]:
        if h["name"] == name:
            return h
    return None


# An optimizer name followed by this names its block-wise 8-bit state (docs/numerics.md 8f),
# for the optimizers whose entry has q8: "adamw8bit", "adam8bit" (the library's names:
# _core.optimizer_choice parses them).
Q8_SUFFIX = _core.Q8_NAME_SUFFIX
Q8_NAMES = tuple(e["name"] + Q8_SUFFIX for e in TABLE if e["q8"])
Q8_BLOCK_SIZE = _core.Q8_BLOCK_SIZE


def entry_q8(name, where: str):
    """Returns (entry, q8): the table entry of `name`, or of the optimizer whose 8-bit name
    (Q8_NAMES) it is, with q8 True; else raises ValueError from `where` naming 'optimizer'."""
    base, q8 = None, False
    if isinstance(name, str):
        try:
            base, q8, _ = _core.optimizer_choice(name)
        except ValueError:
            pass
    if base is None:
        raise ValueError(f"{where}: 'optimizer' must be one of "
                         + ", ".join(repr(n) for n in NAMES + Q8_NAMES) + f"; got {name!r}")
    return _BY_NAME[base], q8


def q8_defaults(e: dict) -> dict:
    """The fields entry `e`'s 8-bit variant sets beside the optimizer's defaults (the
    library's: torchao's formula where the optimizer has it, the 8-bit peer's bits)."""
    return _core.optimizer_choice(e["name"] + Q8_SUFFIX)[2] if e["q8"] else {}


def check_q8_arguments(block_size, min_8bit_size, where: str) -> None:
    """Raises ValueError from `where` naming the argument unless block_size is
    Q8_BLOCK_SIZE (the only block of 8-bit state) and min_8bit_size an int >= 0."""
    if type(block_size) is not int or block_size != Q8_BLOCK_SIZE:
        raise ValueError(f"{where}: 'block_size' must be {Q8_BLOCK_SIZE} (the block of "
                         f"8-bit state, docs/numerics.md 8f), got {block_size!r}")
    if type(min_8bit_size) is not int or min_8bit_size < 0:
        raise ValueError(f"{where}: 'min_8bit_size' must be an int >= 0, got "
                         f"{min_8bit_size!r}")
