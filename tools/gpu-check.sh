#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: builds the default preset (kernels for sm_80/90/100)
# and runs every test labelled `gpu`, then the unit tests, printing the device. Meant
# to finish in a few minutes (the device tool's budget); pass extra ctest arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,pci.bus_id,memory.total --format=csv || true
tools/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default
ctest --preset default -L gpu --output-on-failure "$@"
ctest --preset default -L unit "$@"
