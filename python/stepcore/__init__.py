"""stepcore: the numerics of a training step after backward, from Python.

The CPU engine (AdamW, SignSGD, accumulate, scale, the exact norm partial) over arrays
passed through DLPack (torch tensors, numpy arrays) without copies. Importing stepcore
never imports torch; ``stepcore.torch`` is the PyTorch layer.
"""

from ._core import (
    PARTIAL_MAX_ABS_WORD,
    PARTIAL_WORDS,
    Engine,
    __version__,
    clip_coefficient,
    finalize,
    supported_isas,
)

__all__ = [
    "Engine",
    "PARTIAL_MAX_ABS_WORD",
    "PARTIAL_WORDS",
    "__version__",
    "clip_coefficient",
    "finalize",
    "supported_isas",
]
