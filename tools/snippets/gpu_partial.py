"""Prelude of docs/python.md's all-reduce of a device partial (runs only with CUDA).

One rank's norm partial of some CUDA gradients (`partial`), the buffers
`finalize_and_clip` writes (`result`, `clip`, `found_inf`), `max_norm`, and a process
group of one rank (`dist`, NCCL) for the collectives.
"""

import os

import torch
import torch.distributed as dist

import stepcore
import stepcore.gpu

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")
dist.init_process_group("nccl", rank=0, world_size=1)
grads = [torch.randn(1000, device="cuda"), torch.randn(70_000, device="cuda")]
partial = torch.empty(stepcore.gpu.NORM_PARTIAL_BYTES, dtype=torch.uint8, device="cuda")
workspace = torch.empty(stepcore.gpu.scale_and_norm_workspace_bytes(grads), dtype=torch.uint8,
                        device="cuda")
stepcore.gpu.scale_and_norm_partial(grads, 1.0, partial, workspace)
result = torch.empty(stepcore.gpu.NORM_RESULT_BYTES, dtype=torch.uint8, device="cuda")
clip = torch.empty((), dtype=torch.float32, device="cuda")
found_inf = torch.empty((), dtype=torch.int32, device="cuda")
max_norm = 1.0
