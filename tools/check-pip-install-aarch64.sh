#!/usr/bin/env bash
# Purpose: shows that the Python package builds and installs on aarch64 (Grace, Graviton):
# scikit-build-core is cross-configured on this x86_64 host, and everything after the
# compiler runs on the target's own Python under qemu-user.
#
#   1. A clean copy of the tracked files is built into a wheel by the build machine's pip
#      (`pip wheel .`, scikit-build-core, no build isolation) with Debian's cross toolchain
#      (cmake/toolchains/aarch64-linux-gnu.cmake) and the target's Python headers
#      (libpython3.11-dev:arm64 in the arm64 root of tools/aarch64-python-root.sh). The
#      target Python itself, run under qemu, names the extension suffix and the platform tag.
#   2. The arm64 Python's own pip, under qemu, installs that wheel (`pip install
#      stepcore-*-linux_aarch64.whl`), checking its tags against the target interpreter.
#   3. Under qemu, the installed package imports without torch, picks neon, and the
#      numpy-only Python suites run (test_core.py, test_managers.py; tests that start
#      sys.executable as a subprocess are deselected: without binfmt_misc an emulated
#      program cannot start another aarch64 program).
#
# A native `pip install .` on an aarch64 machine needs none of this: the same pyproject.toml
# and CMake build as on x86 (the NEON engine is selected by the compiler's target).
#
# Usage: tools/check-pip-install-aarch64.sh [<host python with scikit-build-core, nanobind>]
#        (default: the venv of tools/setup-python.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
src_dir="$PWD"
tools/install-deps.sh --aarch64  # cross toolchain, qemu-user, the arm64 architecture in apt
PY="${1:-$(tools/setup-python.sh | tail -n 1)/bin/python}"
ROOT="$(tools/aarch64-python-root.sh | tail -n 1)"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

guest() {  # guest ARGS...: the root's Python 3.11 under qemu, with the installed package
  qemu-aarch64 -L "$ROOT" \
    -E LD_LIBRARY_PATH="$ROOT/lib/aarch64-linux-gnu:$ROOT/usr/lib/aarch64-linux-gnu" \
    -E PYTHONPATH="$scratch/site:$ROOT/pysite" -E PYTHONNOUSERSITE=1 -E PYTHONDONTWRITEBYTECODE=1 \
    "$ROOT/usr/bin/python3.11" "$@"
}

start=$SECONDS
mkdir -p "$scratch/src"
git ls-files -z | tar --null -T - -cf - | tar -xf - -C "$scratch/src"
suffix="$(guest -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
platform="$(guest -c 'import sysconfig; print(sysconfig.get_platform())')"
pyinc="$(guest -c 'import sysconfig; print(sysconfig.get_config_var("INCLUDEPY"))')"  # as installed
echo "aarch64 pip: target Python: suffix $suffix, platform $platform, headers $ROOT$pyinc"

# 1. The cross build. python-hints off: the hints would describe the build machine's Python;
#    the interpreter named here only runs nanobind's CMake helpers. The headers' pyconfig.h
#    includes <aarch64-linux-gnu/python3.11/pyconfig.h>, hence the root's usr/include.
_PYTHON_HOST_PLATFORM="$platform" SETUPTOOLS_EXT_SUFFIX="$suffix" \
  "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$scratch/dist" \
  -C cmake.toolchain-file="$src_dir/cmake/toolchains/aarch64-linux-gnu.cmake" \
  -C cmake.python-hints=false \
  -C cmake.define.Python_EXECUTABLE="$PY" \
  -C cmake.define.Python_INCLUDE_DIR="$ROOT$pyinc" \
  -C cmake.define.CMAKE_CXX_STANDARD_INCLUDE_DIRECTORIES="$ROOT/usr/include" \
  -C cmake.define.STEPCORE_CUDA=OFF \
  "$scratch/src"
wheel="$(ls "$scratch"/dist/stepcore-*.whl)"
case "$wheel" in
  *-linux_aarch64.whl) ;;
  *) echo "aarch64 pip: the wheel is not tagged linux_aarch64: ${wheel##*/}" >&2; exit 1 ;;
esac
echo "aarch64 pip: built ${wheel##*/} in $((SECONDS - start)) s"

# 2. The target's pip installs it.
guest -m pip install -q --no-index --no-deps --disable-pip-version-check --root-user-action=ignore --target "$scratch/site" "$wheel"
so="$(ls "$scratch"/site/stepcore/_core*.so)"
readelf -h "$so" | grep -q 'Machine:.*AArch64' || { echo "aarch64 pip: $so is not AArch64" >&2; exit 1; }

# 3. Exercised under qemu, from outside the source tree.
cd "$scratch"
guest - <<'PYEOF'
import platform, sys
import stepcore
assert "torch" not in sys.modules, "import stepcore imported torch"
assert platform.machine() == "aarch64", platform.machine()
assert "/site/stepcore/" in stepcore.__file__, stepcore.__file__  # the installed copy
e = stepcore.Engine(threads=2)
assert e.isa == "neon", e.isa
print("aarch64 pip: stepcore", stepcore.__version__, "from", stepcore.__file__, "ISA", e.isa,
      "ISAs", stepcore.supported_isas())
PYEOF
guest -m pytest -q -p no:cacheprovider "$src_dir/python/tests/test_core.py" \
  "$src_dir/python/tests/test_managers.py" -k "not test_import_does_not_import_torch"
echo "aarch64 pip: everything took $((SECONDS - start)) s"
