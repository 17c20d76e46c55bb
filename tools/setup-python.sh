#!/usr/bin/env bash
# Purpose: the Python environment the Python package builds and is tested in: the CPU-only
# torch venv of tools/golden/setup_torch.sh plus nanobind, scikit-build-core and pytest, all
# from PyPI. Idempotent. Prints the venv's directory on the last line.
#
# Environment: STEPCORE_TORCH_VENV (default /opt/torchenv), as setup_torch.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${STEPCORE_TORCH_VENV:-/opt/torchenv}"
tools/golden/setup_torch.sh >/dev/null
"$VENV/bin/python" -m pip install -q nanobind scikit-build-core pytest
echo "$VENV"
