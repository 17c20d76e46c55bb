#!/usr/bin/env bash
# Purpose: shows that `pip install .` builds and installs the Python package from a clean
# copy of the checkout (the ctest Python.PipInstallFromACleanCopy): the tracked files are
# copied to a scratch directory, pip builds them with scikit-build-core (no build
# isolation: nanobind and scikit-build-core come from the venv, so no network is needed),
# and the installed package is imported from outside the source tree.
#
# The wheel is built CPU-only and at -O1 instead of Release's -O3: the same sources, CMake,
# install rules and stub generation as a user's `pip install .`, at half the compile time
# (this checks the packaging; the build the suites run compiles the same sources at -O3).
# Not -O0: GCC 12 cannot compile xsimd's AVX-512BW code without optimisation.
#
# Usage: tools/check-pip-install.sh <python> [<runner>]   (runner: e.g. the torch venv's py)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="$1"
RUN="${2:-$1}"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/src"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$scratch/src"
"$PY" -m pip install -q --no-build-isolation --no-deps --target "$scratch/site" \
  -C cmake.define.STEPCORE_CUDA=OFF -C "cmake.define.CMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" \
  "$scratch/src"
cd "$scratch"
PYTHONPATH="$scratch/site" "$RUN" - <<'PYEOF'
import sys
import stepcore
assert "torch" not in sys.modules, "import stepcore imported torch"
import stepcore.diff, tempfile, numpy as np
assert "torch" not in sys.modules, "import stepcore.diff imported torch"
with tempfile.TemporaryDirectory() as d:  # the comparer is in the wheel (diff/)
    with stepcore.diff.Recorder(d + "/r") as rec:
        rec.record("p", "w", np.ones(3, np.float32))
    assert stepcore.diff.compare(d + "/r", d + "/r")["identical"]
assert "torch" not in sys.modules, "stepcore.diff.compare imported torch"
assert "/site/stepcore/" in stepcore.__file__, stepcore.__file__  # the installed copy
e = stepcore.Engine(threads=1)
print("pip install: stepcore", stepcore.__version__, "from", stepcore.__file__, "ISA", e.isa)
PYEOF
