"""Prints docs/optimizers.md's generated table from the library's optimizer table.

``stepcore.optimizer_table()`` (built from the C++ optimizer units) gives each optimizer's
name, hyper-parameters (role, kind, default), state slots (initial field, never negative),
whether it counts steps and whether its gradient read applies the step's scale and clip;
``stepcore.torch.optimizer_class`` names its drop-in. tools/check-snippets.py compares the
region with this output (``--fix`` rewrites it), so a new unit appears with no edit.
"""

import stepcore
import stepcore.torch


def value(h) -> str:
    """A default as the docs write it: numbers as Python prints them, flags lower case."""
    v = h["default"]
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def slot(s) -> str:
    """A slot's name with where it starts and its sign, when not the defaults."""
    notes = []
    if s["initial"]:
        notes.append(f"starts at `{s['initial']}`")
    if s["non_negative"]:
        notes.append("never negative")
    return f"`{s['name']}`" + (f" ({', '.join(notes)})" if notes else "")


def main() -> None:
    table = stepcore.optimizer_table()
    print("| optimizer | `stepcore.torch` drop-in | state slots | step counter "
          "| gradient read scaled and clipped |")
    print("|---|---|---|---|---|")
    for e in table:
        slots = ", ".join(slot(s) for s in e["slots"]) or "none"
        print(f"| `{e['name']}` | `{stepcore.torch.optimizer_class(e['name']).__name__}` "
              f"| {slots} | {'yes' if e['counts_steps'] else 'no'} "
              f"| {'yes' if e['reads_scaled'] else 'no'} |")
    for e in table:
        print()
        print(f"### `{e['name']}`")
        print()
        print("| hyper-parameter | role | kind | default |")
        print("|---|---|---|---|")
        for h in e["hyper"]:
            print(f"| `{h['name']}` | {h['role']} | {h['kind']} | {value(h)} |")


if __name__ == "__main__":
    main()
