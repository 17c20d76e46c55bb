#!/usr/bin/env bash
# Purpose: build an arm64 (aarch64) root with Debian's Python 3.11 and PyPI's aarch64
# torch wheel, run under qemu-user on an x86_64 host, so tools/golden/make_golden.py can
# show how torch's fused CPU optimizers compute on aarch64 (tests/data/aarch64/); and the
# `py` wrapper that runs that Python.
#
# Sources: Debian (apt-get download, arm64 .debs unpacked with dpkg -x by
# tools/aarch64-python-root.sh; nothing is installed into the host's dpkg database) and PyPI (pip download for the aarch64 platform, then
# `pip install --target` of those wheels; the host pip never runs aarch64 code).
#
# Needs on the host: qemu-user (qemu-aarch64), apt with the arm64 architecture added
# (dpkg --add-architecture arm64 && apt-get update), pip for a Python 3.11-compatible tag set.
#
# Idempotent: .debs and wheels already downloaded are reused, a root that already holds the
# wanted Python and torch is left as it is, the wrapper is rewritten only when it changes.
#
# Environment (all optional):
#   STEPCORE_A64_ROOT       the arm64 root                          (default /opt/arm64root)
#   STEPCORE_A64_DL         download directory for .debs and wheels (default /tmp/a64dl)
#   STEPCORE_TORCH_VERSION  torch version                           (default 2.15.0)
#   PIP                     host pip command                        (default "python3 -m pip")
#
# Afterwards:
#   /opt/arm64root/py -c 'import torch; print(torch.backends.cpu.get_cpu_capability())'
#   QEMU_CPU=max,sve128=on /opt/arm64root/py tools/golden/make_golden.py --any-capability \
#       --out tests/data/aarch64
# qemu reads QEMU_CPU from the environment the wrapper passes on. torch 2.15.0 reports (checked):
#   QEMU_CPU unset or max (SVE, 512-bit vectors)  -> DEFAULT  (neither 128 nor 256 bits)
#   QEMU_CPU=max,sve=off                           -> DEFAULT  (NEON only, e.g. Graviton2)
#   QEMU_CPU=max,sve128=on                         -> SVE128   (Neoverse V2: Grace, Graviton4)
#   QEMU_CPU=max,sve256=on                         -> SVE256   (Neoverse V1: Graviton3)
#
# Pitfall: the loader and libc must come from the same build. This root takes both from the
# same libc6:arm64 .deb; never run its Python with the cross toolchain's
# /usr/aarch64-linux-gnu loader (the first pthread_create then spins forever).
set -euo pipefail

ROOT="${STEPCORE_A64_ROOT:-/opt/arm64root}"
DL="${STEPCORE_A64_DL:-/tmp/a64dl}"
TORCH_VERSION="${STEPCORE_TORCH_VERSION:-2.15.0}"
read -r -a PIPCMD <<<"${PIP:-python3 -m pip}"
SITE="$ROOT/site"                     # the guest's site-packages (on PYTHONPATH)

command -v qemu-aarch64 >/dev/null || { echo "qemu-aarch64 not found (apt-get install qemu-user)" >&2; exit 1; }
mkdir -p "$ROOT" "$DL/debs" "$DL/wheels"

# 1. Debian's arm64 Python 3.11 and the shared libraries it and torch load (libc6 brings
#    ld-linux-aarch64.so.1 and libc.so.6 from one build): the root of
#    tools/aarch64-python-root.sh, which also unpacks numpy, pip and pytest into
#    $ROOT/pysite (not on this wrapper's path).
STEPCORE_A64_DL="$DL" "$(dirname "$0")/../aarch64-python-root.sh" "$ROOT" >/dev/null

# 2. PyPI wheels for aarch64, CPython 3.11. torch's CUDA build links these libraries even
#    when only the CPU is used (versions from torch's Requires-Dist and cuda-toolkit 13.2.2's
#    extras; nccl 2.30.7 has no aarch64 wheel, 2.32.3 has the same soname; cupti's and
#    others' aarch64 wheels are tagged manylinux_2_25, which pip's --platform does not infer
#    from a newer tag, hence the list). cusolver (linalg) and triton are loaded lazily and
#    left out.
PLAT=()
for t in manylinux2014_aarch64 manylinux_2_17_aarch64 manylinux_2_24_aarch64 manylinux_2_25_aarch64 \
         manylinux_2_26_aarch64 manylinux_2_27_aarch64 manylinux_2_28_aarch64 manylinux_2_31_aarch64 \
         manylinux_2_34_aarch64 manylinux_2_35_aarch64 manylinux_2_36_aarch64; do
  PLAT+=(--platform "$t")
done
PIPARGS=(--python-version 3.11 --implementation cp --only-binary=:all: --no-deps "${PLAT[@]}")
WHEELS=(
  "torch==$TORCH_VERSION"
  nvidia-cuda-runtime==13.2.86 nvidia-cublas==13.4.1.3 nvidia-cuda-nvrtc==13.2.86
  nvidia-cufft==12.2.0.57 nvidia-cufile==1.17.1.22 nvidia-cusparse==12.7.10.12
  nvidia-nvjitlink==13.2.86 nvidia-cuda-cupti==13.2.86
  nvidia-cudnn-cu13==9.26.0.51 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.32.3
  nvidia-nvshmem-cu13==3.7.2
  numpy==2.4.6 filelock==4.3.1 typing_extensions==4.16.0 sympy==1.14.0 mpmath==1.3.0
  networkx==3.6.1 jinja2==3.1.6 markupsafe==3.0.4 fsspec==2026.9.0
)
have_torch="$(cat "$SITE"/torch-*.dist-info/METADATA 2>/dev/null | sed -n 's/^Version: //p' | head -n 1 || true)"
stamp="$SITE/.wheels-done"
if [ "$have_torch" != "$TORCH_VERSION" ] || [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "${WHEELS[*]}" ]; then
  # pip download skips a file already in $DL/wheels; wheels fetched earlier into $DL or
  # $DL/deps are linked there first.
  for f in "$DL"/*.whl "$DL"/deps/*.whl; do
    if [ -e "$f" ] && [ ! -e "$DL/wheels/${f##*/}" ]; then
      ln "$f" "$DL/wheels/" 2>/dev/null || cp "$f" "$DL/wheels/"
    fi
  done
  "${PIPCMD[@]}" download "${PIPARGS[@]}" -d "$DL/wheels" "${WHEELS[@]}"
  files=()
  for spec in "${WHEELS[@]}"; do             # every entry is pinned: name==version
    name="${spec%%==*}"; name="${name//-/_}"; ver="${spec#*==}"
    f="$(ls -1 "$DL/wheels/" | grep -i "^${name}-${ver}-" | grep -E '(aarch64|none-any)\.whl$' | head -n 1 || true)"
    [ -n "$f" ] || { echo "no wheel for $spec in $DL/wheels" >&2; exit 1; }
    files+=("$DL/wheels/$f")
  done
  rm -rf "$SITE"
  "${PIPCMD[@]}" install "${PIPARGS[@]}" --target "$SITE" "${files[@]}"
  echo "${WHEELS[*]}" >"$stamp"
fi

# 3. What an arm64 kernel would show in /proc and /sys. qemu-user 7.2 passes the x86 host's
#    /proc/cpuinfo through and the host has no regs/identification/midr_el1, so torch's
#    cpuinfo library finds no arm64 processor and its static initialiser dereferences NULL
#    (import torch segfaults; oneDNN's xbyak_aarch64 also prints "Can't open MIDR_EL1 sysfs
#    entry"). qemu -L resolves these absolute paths in the root first, so fake ones there:
#    a Neoverse V2 (Grace: MIDR 0x410fd4f0) per host CPU. The ISA features torch dispatches
#    on come from the auxiliary vector (HWCAP/HWCAP2) and prctl(PR_SVE_GET_VL), i.e. from
#    qemu's emulated CPU (QEMU_CPU), not from this text.
ncpu="$(getconf _NPROCESSORS_CONF)"
cpuinfo="$(mktemp)"
for ((i = 0; i < ncpu; i++)); do
  printf 'processor\t: %d\nBogoMIPS\t: 2000.00\n' "$i"
  printf 'Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs sb paca pacg dcpodp sve2 sveaes svepmull svebitperm svesha3 svesm4 flagm2 frint svei8mm svebf16 i8mm bf16 dgh rng bti\n'
  printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd4f\nCPU revision\t: 0\n\n'
  d="$ROOT/sys/devices/system/cpu/cpu$i/regs/identification"
  mkdir -p "$d"
  echo 0x00000000410fd4f0 >"$d/midr_el1"
done >"$cpuinfo"
mkdir -p "$ROOT/proc"
if ! cmp -s "$cpuinfo" "$ROOT/proc/cpuinfo"; then
  install -m 0644 "$cpuinfo" "$ROOT/proc/cpuinfo"
fi
rm -f "$cpuinfo"

# 4. The wrapper. qemu -L makes the guest's absolute paths look in the root first (so
#    /lib/ld-linux-aarch64.so.1 is the root's); -E sets the guest's environment: the root's
#    libraries first, then torch's and the NVIDIA wheels' (torch's RUNPATH names them too).
libs="$ROOT/lib/aarch64-linux-gnu:$ROOT/usr/lib/aarch64-linux-gnu:$SITE/torch/lib"
for d in cu13/lib cudnn/lib cusparselt/lib nccl/lib nvshmem/lib; do
  libs="$libs:$SITE/nvidia/$d"
done
wrapper="$(mktemp)"
cat >"$wrapper" <<EOF
#!/bin/sh
# Generated by tools/golden/setup_torch_aarch64.sh: the arm64 Python 3.11 with torch
# $TORCH_VERSION, emulated. QEMU_CPU (e.g. max, max,sve=off, max,sve128=on) picks the CPU.
exec qemu-aarch64 -L $ROOT \\
  -E LD_LIBRARY_PATH=$libs \\
  -E PYTHONPATH=$SITE -E PYTHONNOUSERSITE=1 -E PYTHONDONTWRITEBYTECODE=1 \\
  $ROOT/usr/bin/python3.11 "\$@"
EOF
if ! cmp -s "$wrapper" "$ROOT/py"; then
  install -m 0755 "$wrapper" "$ROOT/py"
fi
rm -f "$wrapper"

# 5. Check: torch imports and reports its CPU capability under the default emulated CPU.
"$ROOT/py" -c 'import platform, torch; print(platform.machine(), "torch", torch.__version__, "CPU capability", torch.backends.cpu.get_cpu_capability())'
