"""Prints docs/managers.md's table of bytes per parameter, by mode and optimizer, from the
planner (``stepcore.plan_memory``: the figures the managers' memory() reports).

The model is 7,000,000,000 bf16 parameters on one rank (the managers' own gradient and
compute buffers), steps of two micro-batches (mode full also of one), without overlap; the
bytes are held in the steady state, divided by the parameter count. The rings and the
scalars are bounded, so at this size they round away; tools/check-snippets.py compares the
region with this output (``--fix`` rewrites it).
"""

import stepcore

COUNT = 7_000_000_000
OPTIMIZERS = [("adamw", None), ("adamw", {"amsgrad": True}), ("adam", None), ("lion", None),
              ("sign_sgd", None), ("sgd", None), ("sgd", {"momentum": 0.9}), ("adagrad", None)]


def per_param(plan, key):
    return f"{plan[key] / COUNT:.2f}"


def main() -> None:
    print("| optimizer | state slots | none: device | optimizer: host / device "
          "| full, 2+ micro-batches: host / device | full, 1 micro-batch: host |")
    print("|---|---|---|---|---|---|")
    for name, hyper in OPTIMIZERS:
        plans = {}
        for mode, micro in (("none", 2), ("optimizer", 2), ("full", 2), ("full", 1)):
            plans[mode, micro] = stepcore.plan_memory(COUNT, offload=mode, optimizer=name,
                                                      hyper=hyper, micro_batches=micro)
        slots = [k for k in plans["full", 2]["kinds"] if k not in (
            "master", "accumulator", "staging", "upload", "fetch", "speculation",
            "gradient@device", "compute@device", "speculation_device@device")]
        label = f"`{name}`" + (" " + ", ".join(f"{k}={v}" for k, v in hyper.items())
                               if hyper else "")
        print(f"| {label} | {', '.join(slots) or 'none'} "
              f"| {per_param(plans['none', 2], 'device_bytes')} "
              f"| {per_param(plans['optimizer', 2], 'host_bytes')} / "
              f"{per_param(plans['optimizer', 2], 'device_bytes')} "
              f"| {per_param(plans['full', 2], 'host_bytes')} / "
              f"{per_param(plans['full', 2], 'device_bytes')} "
              f"| {per_param(plans['full', 1], 'host_bytes')} |")


if __name__ == "__main__":
    main()
