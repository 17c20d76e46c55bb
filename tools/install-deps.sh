#!/usr/bin/env bash
# Installs the Debian packages stepcore builds and tests with; idempotent and quiet
# when everything is already there. The CUDA toolkit (/usr/local/cuda) is optional:
# without it the build is CPU-only.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libgtest-dev libgmock-dev libbenchmark-dev
  libxsimd-dev libhwloc-dev hwloc libnuma-dev
  libopenmpi-dev openmpi-bin
  nlohmann-json3-dev  # stepcore-diff (JSON of safetensors headers and recording manifests)
  python3-dev python3-venv python3-pip  # the Python package: headers, the test venv, pip
)

# --sanitizers adds what the tsan and fuzz presets need: clang (libFuzzer, TSan) and
# LLVM's OpenMP with its Archer tool (--tsan is the older name).
if [ "${1:-}" = "--sanitizers" ] || [ "${1:-}" = "--tsan" ]; then
  packages+=(clang libomp-dev)
fi

# --aarch64 adds the cross build of the `aarch64` preset: Debian's cross toolchain, qemu-user
# to run its programs, and the target's libraries from the arm64 multiarch archive (hwloc,
# GoogleTest; libgomp and libstdc++ come with the compiler).
arm64=()
if [ "${1:-}" = "--aarch64" ]; then
  packages+=(g++-aarch64-linux-gnu qemu-user)
  arm64=(libc6-dev:arm64 libhwloc-dev:arm64 libgtest-dev:arm64)
fi

missing=()
for p in "${packages[@]}" "${arm64[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}" >&2
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
if [ ${#arm64[@]} -gt 0 ] && ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $sudo dpkg --add-architecture arm64
fi
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
