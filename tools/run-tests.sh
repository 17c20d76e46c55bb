#!/usr/bin/env bash
# The README's test command: installs what is missing, configures the default
# preset (CUDA kernels compiled for sm_80/90/100 when nvcc exists), builds, and runs
# every test (unit, mpi; gpu tests skip with a message when there is no device).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default
ctest --preset default "$@"
