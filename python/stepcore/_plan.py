"""stepcore.plan_memory: what each rank's gradient manager will allocate for a model, by
kind, and whether it fits (docs/python.md, "Planning memory"; docs/managers.md).

The model may be an int (a parameter count), a list of shapes, a Hugging Face
``config.json`` (a path, or its dict) or a ``torch.nn.Module`` (its parameters' shapes and
dtypes; torch is imported only to recognise one). This adapter checks the arguments' types
and turns the model into records; the shards, sizes and bytes are the C++ planner's
(``stepcore/plan.hpp``), the same figures as ``stepcore-plan`` and ``GradientManager.memory()``.
"""

from __future__ import annotations

import json
import os
import sys
from numbers import Integral

from . import _core, _table

_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _size(name: str, value, *, minimum: int = 0) -> int:
    """An integer size: TypeError naming `name` for anything not an int (a float such as
    7e9, a bool, a string), ValueError for a negative one or one under `minimum`."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"stepcore: invalid_argument in '{name}': sizes are integers, "
                        f"not {type(value).__name__} {value!r}")
    value = int(value)
    if value < 0:
        raise ValueError(f"stepcore: invalid_argument in '{name}': {value} is negative")
    if value < minimum:
        raise ValueError(f"stepcore: out_of_range in '{name}': {value}: must be at least "
                         f"{minimum}")
    if value >= 1 << 64:
        raise ValueError(f"stepcore: out_of_range in '{name}': {value} does not fit 64 bits")
    return value


def _budget(name: str, value) -> int:
    """A byte budget: None (everything: -1) or a size."""
    return -1 if value is None else _size(name, value)


def _module_records(model):
    """(name, shape, dtype) of each parameter of a torch module."""
    records = []
    for name, p in model.named_parameters():
        dtype = str(p.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise TypeError(f"stepcore: unsupported_dtype in 'model.{name}': {p.dtype}: "
                            "expected float32, bfloat16 or float16")
        records.append((name, [int(d) for d in p.shape], _DTYPES[dtype]))
    return records


def _model(model, dtype):
    """(kind, value) for _core.plan_model."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return "shapes", _module_records(model)
    if isinstance(model, (str, os.PathLike)):
        return "hf_path", os.fspath(model)
    if isinstance(model, dict):
        try:
            return "hf_json", json.dumps(model)
        except (TypeError, ValueError) as e:
            raise TypeError(f"stepcore: invalid_argument in 'model': a config dict holds JSON "
                            f"values: {e}") from None
    if isinstance(model, (list, tuple)):
        records = []
        for i, shape in enumerate(model):
            if isinstance(shape, Integral) and not isinstance(shape, bool):
                dims = [shape]
            elif isinstance(shape, (list, tuple)):  # torch.Size is a tuple
                dims = list(shape)
            else:
                raise TypeError(f"stepcore: invalid_argument in 'model[{i}]': a shape is an "
                                f"int or a sequence of ints, not {type(shape).__name__}")
            dims = [_size(f"model[{i}]", d) for d in dims]
            records.append((f"params[{i}]", dims, dtype or "bf16"))
        return "shapes", records
    if isinstance(model, bool) or not isinstance(model, Integral):
        raise TypeError("stepcore: invalid_argument in 'model': a parameter count (int), a "
                        "list of shapes, a Hugging Face config (path or dict) or a "
                        f"torch.nn.Module, not {type(model).__name__} {model!r}")
    return "count", _size("model", model)


def plan_memory(model, *, offload: str, optimizer: str = "adamw", hyper: dict | None = None,
                ranks: int = 1, ranks_per_node: int = 1, micro_batches: int = 2,
                overlap: bool = False, speculation: str = "auto",
                speculation_bytes: int | None = None, speculation_device_bytes: int = 0,
                ring_slots: int | None = None, ring_slot_elements: int = 1 << 19,
                chunk_elements: int = 16 << 20, checkpoint: str = "none",
                host_memory: int | None = None, gpu_memory: int | None = None,
                dtype: str | None = None, trainer_buffers: bool | None = None,
                min_8bit_size: int = 4096) -> dict:
    """Predicts what each rank's gradient manager allocates for `model` sharded over `ranks`
    (FSDP: every parameter's shard is ceil(numel / ranks) elements on rank 0, the rank
    planned): a dict like ``GradientManager.report()["memory"]`` ('kinds': {'<kind>' or
    '<kind>@device': {'device', 'bytes', 'peak'}}, host_bytes, host_peak, device_bytes,
    device_peak) for steps of `micro_batches` micro-batches (overlapped: `overlap`), then a
    `checkpoint` 'save' or 'load' at the peak; plus model_params, params_per_rank, tensors,
    node_host_peak (the host peak of `ranks_per_node` ranks) and fits_host / fits_gpu
    (against `host_memory` bytes per node and `gpu_memory` per GPU; None when not given).

    `model`: an int (a parameter count, planned as tensors of 2^24 elements), a list of
    shapes (each an int or a sequence of ints), a Hugging Face config.json (a path or its
    dict: a Llama/Mistral/Qwen-style decoder) or a torch.nn.Module (its parameters' shapes
    and dtypes). `dtype` ('bf16', 'f16', 'f32') is the gradients' and compute weights' dtype
    (default bf16; a config's torch_dtype; a module's own). `hyper`: the optimizer's fields
    (e.g. {'momentum': 0.9}). `speculation_bytes` None: every chunk; `ring_slots` None: the
    default ring. `trainer_buffers`: gradients and compute weights in the model's own tensors
    (no device gradient or compute buffers), as stepcore.torch.GradientManager does; None:
    True for a torch.nn.Module, else False. `optimizer` "adamw8bit" or "adam8bit" plans
    block-wise 8-bit state for every shard of at least `min_8bit_size` elements
    (ManagerConfig::q8_state). Sizes must be ints: a float (7e9) or a bool raises TypeError, a negative
    size ValueError, each naming the argument; a broken config names its file."""
    entry, q8 = _table.entry_q8(optimizer, "stepcore")
    _table.check_q8_arguments(_table.Q8_BLOCK_SIZE, min_8bit_size, "stepcore")
    optimizer = entry["name"]
    if q8:  # the 8-bit variant's defaults (torchao's formula), as GradientManager's
        hyper = {**_table.q8_defaults(entry), **(hyper or {})}
    kind, value = _model(model, dtype)
    if trainer_buffers is None:
        torch = sys.modules.get("torch")
        trainer_buffers = torch is not None and isinstance(model, torch.nn.Module)
    fields = []
    for k, v in (hyper or {}).items():
        if isinstance(v, str):
            fields.append((k, v))
        elif isinstance(v, (bool, Integral, float)):
            fields.append((k, float(v)))
        else:
            raise TypeError(f"stepcore: invalid_argument in '{optimizer}.{k}': a number, a "
                            "bool or (formula) a name")
    return _core.plan_model(
        kind, value, offload, optimizer, fields,
        _size("ranks", ranks, minimum=1), _size("ranks_per_node", ranks_per_node, minimum=1),
        _size("micro_batches", micro_batches, minimum=1), bool(overlap), speculation,
        _budget("speculation_bytes", speculation_bytes),
        _budget("speculation_device_bytes", speculation_device_bytes),
        -1 if ring_slots is None else _size("ring_slots", ring_slots, minimum=1),
        _size("ring_slot_elements", ring_slot_elements, minimum=1),
        _size("chunk_elements", chunk_elements, minimum=1), checkpoint,
        None if host_memory is None else _size("host_memory", host_memory),
        None if gpu_memory is None else _size("gpu_memory", gpu_memory), dtype,
        bool(trainer_buffers), q8, min_8bit_size)
