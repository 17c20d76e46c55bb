"""stepcore: the numerics of a training step after backward, from Python.

The CPU engine (AdamW, SignSGD, any optimizer by name through ``Engine.step``,
accumulate, scale, the exact norm partial) over arrays
passed through DLPack (torch tensors, numpy arrays) without copies, the gradient managers
and their memory planner (``plan_memory``), in-process communicators and NUMA placement,
the optimizer table (``optimizer_table()``: every optimizer's name, hyper-parameters,
slots) and the scalar reference
(``reference_step``, the oracle); ``stepcore.gpu`` holds the GPU launchers on
device arrays. Importing stepcore never imports torch; ``stepcore.torch`` is the PyTorch
layer.
"""

from . import gpu
from ._plan import plan_memory
from ._core import (
    PARTIAL_MAX_ABS_WORD,
    PARTIAL_WORDS,
    Q8_BLOCK_SIZE,
    Communicator,
    Engine,
    GradientManager,
    __version__,
    clip_coefficient,
    finalize,
    local_rank_from_env,
    local_world_size_from_env,
    make_in_process_group,
    numa_place_on_node,
    numa_placement,
    optimizer_slots,
    optimizer_table,
    optimizers,
    q8_map,
    reference_step,
    supported_isas,
)

__all__ = [
    "Communicator",
    "Engine",
    "GradientManager",
    "gpu",
    "local_rank_from_env",
    "local_world_size_from_env",
    "make_in_process_group",
    "numa_place_on_node",
    "numa_placement",
    "optimizer_slots",
    "optimizer_table",
    "optimizers",
    "plan_memory",
    "q8_map",
    "reference_step",
    "PARTIAL_MAX_ABS_WORD",
    "PARTIAL_WORDS",
    "Q8_BLOCK_SIZE",
    "__version__",
    "clip_coefficient",
    "finalize",
    "supported_isas",
]
