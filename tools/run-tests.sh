#!/usr/bin/env bash
# The README's test command: installs what is missing (Debian packages; the Python venv
# with CPU-only torch, nanobind and pytest from PyPI), configures the default preset
# (CUDA kernels compiled for sm_80/90/100 when nvcc exists, the Python package), builds,
# and runs every test (unit, mpi, python; gpu tests skip with a message when there is no
# device); then the emulated aarch64 part (tools/run-aarch64.sh: the neon suites and the
# demo under qemu-aarch64; STEPCORE_SKIP_AARCH64=1 skips it). Arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
venv="$(tools/setup-python.sh | tail -n 1)"
cmake --preset default -DSTEPCORE_PYTHON=ON -DPython_EXECUTABLE="$venv/bin/python" \
  -DSTEPCORE_PYTHON_RUNNER="$venv/py" >/dev/null
cmake --build --preset default
ctest --preset default "$@"
if [ "${STEPCORE_SKIP_AARCH64:-0}" != 1 ]; then
  tools/run-aarch64.sh build/default/apps/stepcore-demo
fi
