#!/usr/bin/env bash
# Purpose: an arm64 (aarch64) root that runs Debian's Python 3.11 under qemu-user on an
# x86_64 host, for what must run on the target's Python: installing and testing the
# cross-built wheel (tools/check-pip-install-aarch64.sh) and, with torch added, the golden
# files of torch's aarch64 build (tools/golden/setup_torch_aarch64.sh builds on this root).
#
# The root gets, idempotently:
#   - Debian arm64 .debs (apt-get download, unpacked with dpkg -x; nothing enters the host's
#     dpkg database): Python 3.11 and the libraries it loads, its headers
#     (libpython3.11-dev, which the cross build compiles against) and hwloc, which
#     libstepcore links;
#   - PyPI wheels for CPython 3.11 on aarch64 in <root>/pysite: numpy (stepcore's one
#     dependency), pip (installs the wheel as a user would) and pytest. The host pip only
#     downloads and unpacks them (--target); it never runs aarch64 code.
#
#   tools/aarch64-python-root.sh [ROOT]      (default $STEPCORE_A64_ROOT or /opt/arm64root)
#
# Environment: STEPCORE_A64_DL (download directory, default /tmp/a64dl), PIP (host pip
# command, default "python3 -m pip"). Needs qemu-user and apt with the arm64 architecture.
#
# Pitfall: the loader and libc must come from the same build. This root takes both from one
# libc6:arm64 .deb; never run its Python with the cross toolchain's /usr/aarch64-linux-gnu
# loader (the first pthread_create then spins forever).
set -euo pipefail

ROOT="${1:-${STEPCORE_A64_ROOT:-/opt/arm64root}}"
DL="${STEPCORE_A64_DL:-/tmp/a64dl}"
read -r -a PIPCMD <<<"${PIP:-python3 -m pip}"

command -v qemu-aarch64 >/dev/null || { echo "qemu-aarch64 not found (apt-get install qemu-user)" >&2; exit 1; }
mkdir -p "$ROOT" "$DL/debs" "$DL/wheels"

# 1. Debian arm64 packages. libc6 brings ld-linux-aarch64.so.1 and libc.so.6 from one build.
DEBS=(
  libc6 libgcc-s1 libstdc++6 libgomp1 zlib1g
  python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11-dev
  libexpat1 libffi8 libssl3 libbz2-1.0 liblzma5 libsqlite3-0 libncursesw6 libtinfo6
  libreadline8 libuuid1 libdb5.3 libcrypt1 libnsl2 libtirpc3 libgssapi-krb5-2 libkrb5-3
  libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1
  libhwloc15 libudev1
)
stamp="$ROOT/.debs-done"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${DEBS[*]}" ]; then
  (cd "$DL/debs" && apt-get download "${DEBS[@]/%/:arm64}")
  for p in "${DEBS[@]}"; do
    deb="$(ls -1t "$DL/debs/${p}"_*_arm64.deb | head -n 1)"
    dpkg -x "$deb" "$ROOT"
  done
  echo "${DEBS[*]}" >"$stamp"
fi
test -x "$ROOT/usr/bin/python3.11"
test -f "$ROOT/usr/include/aarch64-linux-gnu/python3.11/pyconfig.h"
# The PT_INTERP /lib/ld-linux-aarch64.so.1 must resolve inside the root (qemu -L looks there
# first); bookworm's libc6 ships it, usrmerge'd roots have it under usr/lib.
test -e "$ROOT/lib/ld-linux-aarch64.so.1"

# 2. PyPI wheels, pinned. numpy's aarch64 wheel is tagged manylinux_2_27/2_28; the others
#    are pure Python.
PIPARGS=(--python-version 3.11 --implementation cp --only-binary=:all: --no-deps
         --platform manylinux_2_28_aarch64 --platform manylinux_2_27_aarch64
         --platform manylinux2014_aarch64 --platform manylinux_2_17_aarch64)
WHEELS=(numpy==2.4.6 pip==26.3 pytest==9.2.0 iniconfig==2.3.1 pluggy==1.7.0 packaging==26.4
        pygments==2.21.0)
stamp="$ROOT/pysite/.wheels-done"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${WHEELS[*]}" ]; then
  "${PIPCMD[@]}" download -q "${PIPARGS[@]}" -d "$DL/wheels" "${WHEELS[@]}"
  files=()
  for spec in "${WHEELS[@]}"; do
    name="${spec%%==*}"; ver="${spec#*==}"
    f="$(ls -1 "$DL/wheels/" | grep -i "^${name}-${ver}-" | grep -E '(aarch64|none-any)\.whl$' | head -n 1 || true)"
    [ -n "$f" ] || { echo "no wheel for $spec in $DL/wheels" >&2; exit 1; }
    files+=("$DL/wheels/$f")
  done
  rm -rf "$ROOT/pysite"
  "${PIPCMD[@]}" install -q "${PIPARGS[@]}" --target "$ROOT/pysite" "${files[@]}"
  echo "${WHEELS[*]}" >"$stamp"
fi
echo "$ROOT"
