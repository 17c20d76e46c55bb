#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: builds the bench preset (kernels for sm_80/90/100,
# tests and benchmarks), runs every test labelled `gpu` (kernels, CUDA device, NCCL,
# managers on the device), the GPU benchmark harness and the NCCL norm benchmark, then
# the unit tests, printing the device. Meant
# to finish in a few minutes (the device tool's budget); pass extra ctest arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,pci.bus_id,memory.total --format=csv || true
tools/install-deps.sh
cmake --preset bench >/dev/null
cmake --build --preset bench
ctest --test-dir build/bench -L gpu --output-on-failure "$@"
build/bench/bench/stepcore-bench-gpu
# The global-norm combination on one GPU (NCCL half; the MPI half runs single-process).
if [ -x build/bench/bench/stepcore-bench-comm ]; then build/bench/bench/stepcore-bench-comm; fi
ctest --test-dir build/bench -L unit "$@"
