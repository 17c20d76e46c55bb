"""stepcore.gpu: the GPU launchers (stepcore/gpu.hpp) on device arrays, from Python.

Thin re-export of the extension's submodule ``stepcore._core.gpu`` (docs/python.md,
"GPU launchers") plus two read-back helpers. Arrays are torch CUDA tensors or any DLPack
array in CUDA memory; device scalars, partials, results and workspaces are the caller's
buffers; ``stream`` is an int (a cudaStream_t address), an object with ``__cuda_stream__``
or None (the first tensor's framework's current stream). The launchers never allocate and
never synchronise. Importing this module does not import torch.
"""

from ._core import gpu as _gpu
from ._core.gpu import (
    BLOCK_ELEMENTS,
    FOUND_INF_NEEDS_EXACT,
    FOUND_INF_NON_FINITE,
    FOUND_INF_NONE,
    MAX_BIAS_TABLE_STEPS,
    NORM_PARTIAL_BYTES,
    NORM_RESULT_BYTES,
    PARTIAL_MAX_INT32,
    PARTIAL_SUM_WORDS,
    accumulate,
    built_with_cuda,
    device_count,
    exact_norm_partial_if_needed,
    finalize_and_clip,
    finalize_exact_and_clip,
    make_optimizer_table,
    norm_partial,
    optimizer_step,
    partial_words,
    q8_codebooks,
    result_values,
    scale_,
    scale_and_norm_partial,
    scale_and_norm_workspace_bytes,
    unavailable_reason,
)

__all__ = [
    "BLOCK_ELEMENTS",
    "FOUND_INF_NEEDS_EXACT",
    "FOUND_INF_NON_FINITE",
    "FOUND_INF_NONE",
    "MAX_BIAS_TABLE_STEPS",
    "NORM_PARTIAL_BYTES",
    "NORM_RESULT_BYTES",
    "PARTIAL_MAX_INT32",
    "PARTIAL_SUM_WORDS",
    "accumulate",
    "built_with_cuda",
    "device_count",
    "exact_norm_partial_if_needed",
    "finalize_and_clip",
    "finalize_exact_and_clip",
    "make_optimizer_table",
    "norm_partial",
    "optimizer_step",
    "partial_words",
    "q8_codebooks",
    "read_partial",
    "read_result",
    "result_values",
    "scale_",
    "scale_and_norm_partial",
    "scale_and_norm_workspace_bytes",
    "unavailable_reason",
]


def _to_host(array):
    """Returns a host copy of a device array: ``.cpu()`` (torch), ``.get()`` (CuPy), or the
    array itself when it is already in host memory (numpy)."""
    if hasattr(array, "cpu"):
        return array.cpu()
    if hasattr(array, "get"):
        return array.get()
    return array


def read_partial(partial):
    """Returns the PARTIAL_WORDS int64 words (``Engine.norm_partial``'s layout, for
    ``stepcore.finalize``) of a device NormPartial buffer. Copies it to the host on its
    framework's current stream and waits for that copy: synchronise the launch's stream
    first when it is another one."""
    return partial_words(_to_host(partial))


def read_result(result):
    """Returns ``(norm, finite, max_abs, needs_exact)`` of a device NormResult buffer (as
    ``stepcore.finalize`` does); copies it to the host as read_partial does."""
    return result_values(_to_host(result))
