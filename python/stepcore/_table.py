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
