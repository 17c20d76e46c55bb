"""stepcore.diff: record a training step's tensors, compare two runs bit for bit.

`Recorder` writes a recording (a directory of one safetensors file per step and rank, a
journal entries.jsonl that each step appends to, and a manifest.json replaced
atomically); `stepcore.torch.GradientManager(..., recorder=rec)` records the manager's
state after every step. `compare(a, b, max_ulps=0)` compares two recordings or two
safetensors files and says where they first diverge, with ulp distances; `python -m
stepcore.diff A B` is its command line. Both are the C++ stepcore-diff's comparer through
stepcore._core (docs/python.md, "Differential testing"; docs/diff.md). Importing this
package never imports torch.
"""

from ._compare import compare, compare_detailed
from ._recording import FORMAT, VERSION, Recorder, Recording, file_name, read_recording
from ._report import write_report
from ._safetensors import DTYPES, ULP_DTYPES, FormatError, SafetensorsFile, read_file, write_file

__all__ = ["DTYPES", "FORMAT", "FormatError", "Recorder", "Recording", "SafetensorsFile",
           "ULP_DTYPES", "VERSION", "compare", "compare_detailed", "file_name", "read_file",
           "read_recording", "write_file", "write_report"]
