#!/usr/bin/env bash
# Rehearses the device check on this machine, as root: a fresh clone of the committed
# HEAD plus .gpu-bundle/ run tools/gpu-check.sh inside a clean Debian chroot (made once
# with debootstrap: build-essential, cmake, ninja-build, python3 and nothing else: no
# -dev package of the build's libraries, no pkg-config, no MPI), with /usr/local/cuda
# bind-mounted read-only and no network (a new network namespace). The CUDA tests skip
# (no GPU); every phase must still pass, and the check may leave at most 8 files in its
# $OUT (what the device tool returns). Logs land in build/gpu-rehearsal/.
#
#   tools/gpu-rehearse.sh [--suite SUITE] [--no-sanitizer | --refusing-sanitizer] [--nccl-wheel]
#                         [--ar] [--pip-cmake]
#     --suite SUITE  Debian release of the chroot (default bookworm; e.g. trixie)
#     --no-sanitizer leave out NVIDIA's compute-sanitizer wheel (PyPI), which is put in the
#                    chroot so the sanitizer phase runs its commands (the GPU machine has
#                    its own; without a driver it cannot instrument, so that phase skips)
#     --refusing-sanitizer  a stand-in compute-sanitizer that answers as on a gVisor host
#                    ("Device not supported", then error 999 at the first allocation):
#                    the sanitizer phase must be a skip that says so
#     --nccl-wheel   take NCCL from the nvidia-nccl wheel of this machine's Python,
#                    mounted where the GPU machine's PyTorch venv has it, not the toolkit's
#     --ar           unpack the bundle with ar + tar, as on a machine without dpkg
#     --pip-cmake    cmake and ninja from PyPI's wheels (newest), as on the GPU machine,
#                    in place of Debian's
# Environment: STEPCORE_REHEARSE_ROOT (chroot folder, default /var/tmp/stepcore-rehearse/SUITE),
# STEPCORE_GPU_BUDGET (the check's budget here, default 3600 s: this machine may be slow).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
root=$PWD
suite=bookworm sanitizer=1 nccl_wheel=0 use_ar=0 pip_cmake=0 max_out_files=8
while [ $# -gt 0 ]; do
  case $1 in
    --suite) suite=${2:?--suite needs a value}; shift ;;
    --no-sanitizer) sanitizer=0 ;;
    --refusing-sanitizer) sanitizer=refusing ;;
    --pip-cmake) pip_cmake=1 ;;
    --nccl-wheel) nccl_wheel=1 ;;
    --ar) use_ar=1 ;;
    *) echo "gpu-rehearse: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done

die() { echo "gpu-rehearse: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "run as root (debootstrap, chroot and mounts need it)"
[ -d /usr/local/cuda/bin ] || die "needs the CUDA toolkit at /usr/local/cuda"
command -v debootstrap >/dev/null || { apt-get install -y -qq debootstrap >/dev/null || die "cannot install debootstrap"; }
[ -f .gpu-bundle/MANIFEST ] || tools/gpu-prepare.sh || die "tools/gpu-prepare.sh failed"

rootfs=${STEPCORE_REHEARSE_ROOT:-/var/tmp/stepcore-rehearse/$suite}
results=$root/build/gpu-rehearsal
mkdir -p "$results" || die "cannot create $results"

# ---- the clean environment (made once, then reused) -------------------------------------
base_packages=build-essential,cmake,ninja-build,python3
if [ ! -f "$rootfs/.stepcore-rehearse-ok" ]; then
  echo "gpu-rehearse: debootstrap $suite into $rootfs (a few minutes, once)"
  rm -rf "$rootfs" && mkdir -p "$rootfs"
  debootstrap --variant=minbase --include="$base_packages" "$suite" "$rootfs" http://deb.debian.org/debian \
    >"$results/debootstrap.log" 2>&1 || die "debootstrap failed: $results/debootstrap.log"
  echo "$base_packages" >"$rootfs/.stepcore-rehearse-ok"
fi
# Nothing the bundle provides may be installed there.
for p in libgtest-dev libgmock-dev googletest libbenchmark-dev libxsimd-dev libhwloc-dev \
  libhwloc15 libnuma-dev libopenmpi-dev openmpi-bin pkg-config pkgconf pkgconf-bin; do
  if chroot "$rootfs" dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    die "$p is installed in $rootfs: not a clean environment (remove $rootfs to start again)"
  fi
done

# ---- a fresh clone of HEAD and the bundle -----------------------------------------------------
head=$(git rev-parse HEAD) || die "not a git checkout"
[ -z "$(git status --porcelain --untracked-files=no)" ] ||
  echo "gpu-rehearse: WARNING: uncommitted changes are not rehearsed (the clone is of $head)"
work=$rootfs/work
rm -rf "$work" "$rootfs/out" && mkdir -p "$work" "$rootfs/out" || die "cannot prepare $work"
git clone --quiet --no-hardlinks "$root" "$work/stepcore" && git -C "$work/stepcore" checkout --quiet --detach "$head" ||
  die "git clone failed"
cp -r .gpu-bundle "$work/stepcore/.gpu-bundle" || die "cannot copy the bundle"
tree_bytes=$(cd "$work/stepcore" && git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
bundle_bytes=$(du -sb "$work/stepcore/.gpu-bundle" | cut -f1)
rm -rf "$work/stepcore/.git"  # what travels to the device has no history

# ---- mounts (undone on exit) ------------------------------------------------------------------
mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[$i]}" 2>/dev/null; done
}
trap cleanup EXIT
bind_ro() {  # bind_ro SOURCE TARGET
  mkdir -p "$2" && mount --bind "$1" "$2" && mounted+=("$2") && mount -o remount,bind,ro "$2" ||
    die "cannot mount $1 read-only on $2"
}
mount -t proc proc "$rootfs/proc" && mounted+=("$rootfs/proc") || die "cannot mount /proc"
mount --bind /dev "$rootfs/dev" && mounted+=("$rootfs/dev") || die "cannot bind /dev"
bind_ro "$(readlink -f /usr/local/cuda)" "$rootfs/usr/local/cuda"

# This machine may have few cores (the GPU machine has 16): a longer budget, so the
# build's time here is measured instead of cut off.
env_extra=(STEPCORE_GPU_BUDGET="${STEPCORE_GPU_BUDGET:-3600}")
if [ "$sanitizer" = refusing ]; then
  mkdir -p "$rootfs/opt/sanitizer-refusing"
  cat >"$rootfs/opt/sanitizer-refusing/compute-sanitizer" <<'STANDIN'
#!/bin/sh
# A stand-in for compute-sanitizer on a host whose device it does not support (gVisor).
[ "$1" = --version ] && { echo "NVIDIA (R) Compute Sanitizer, Version 2025.3.0 (stand-in)"; exit 0; }
echo "========= COMPUTE-SANITIZER"
echo "========= Error: Device not supported"
echo "========= Program hit cudaErrorUnknown (error 999) due to \"unknown error\" on CUDA API call to cudaMalloc."
echo "========= ERROR SUMMARY: 1 error"
exit 99
STANDIN
  chmod +x "$rootfs/opt/sanitizer-refusing/compute-sanitizer"
  env_extra+=(STEPCORE_SANITIZER=/opt/sanitizer-refusing/compute-sanitizer)
elif [ "$sanitizer" = 1 ]; then
  cache=/var/tmp/stepcore-rehearse/wheels
  mkdir -p "$cache"
  ls "$cache"/nvidia_cuda_sanitizer_api-13.0*.whl >/dev/null 2>&1 ||
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$cache" 'nvidia-cuda-sanitizer-api==13.0.*' ||
    die "cannot download nvidia-cuda-sanitizer-api"
  rm -rf "$rootfs/opt/sanitizer" && mkdir -p "$rootfs/opt/sanitizer"
  python3 -m zipfile -e "$(ls "$cache"/nvidia_cuda_sanitizer_api-13.0*.whl | tail -1)" "$rootfs/opt/sanitizer" ||
    die "cannot unpack the sanitizer wheel"
  san=$(cd "$rootfs" && find opt/sanitizer -name compute-sanitizer -type f | head -1)
  [ -n "$san" ] || die "no compute-sanitizer in the wheel"
  chmod -R u+x "$rootfs/$(dirname "$san")"
  env_extra+=(STEPCORE_SANITIZER=/$san)
fi
if [ "$nccl_wheel" = 1 ]; then
  wheel=$(python3 -c 'import importlib.util as u; print(list(u.find_spec("nvidia.nccl").submodule_search_locations)[0])' 2>/dev/null ||
    ls -d /opt/*/lib/python3*/site-packages/nvidia/nccl 2>/dev/null | head -1)
  [ -n "$wheel" ] && [ -f "$wheel/include/nccl.h" ] || die "no nvidia-nccl wheel on this machine"
  bind_ro "$wheel" "$rootfs/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl"
  env_extra+=(STEPCORE_NCCL_SEARCH=wheel)
fi
[ "$use_ar" = 1 ] && env_extra+=(STEPCORE_UNPACK=ar)
path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
if [ "$pip_cmake" = 1 ]; then
  cache=/var/tmp/stepcore-rehearse/wheels
  mkdir -p "$cache/cmake"
  ls "$cache"/cmake/cmake-*.whl "$cache"/cmake/ninja-*.whl >/dev/null 2>&1 ||
    python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 -d "$cache/cmake" cmake ninja || die "cannot download cmake/ninja wheels"
  rm -rf "$rootfs/opt/pycmake" && mkdir -p "$rootfs/opt/pycmake"
  for w in "$cache"/cmake/*.whl; do python3 -m zipfile -e "$w" "$rootfs/opt/pycmake" || die "cannot unpack $w"; done
  ninja_dir=$(cd "$rootfs" && dirname "$(find opt/pycmake -path '*ninja*' -name ninja -type f -size +100k | head -1)")
  [ -n "$ninja_dir" ] && [ "$ninja_dir" != . ] || die "no ninja in the ninja wheel"
  chmod +x "$rootfs"/opt/pycmake/cmake/data/bin/* "$rootfs/$ninja_dir/ninja"
  path=/opt/pycmake/cmake/data/bin:/$ninja_dir:$path
fi

# ---- the check, offline ------------------------------------------------------------------------
isolate=(unshare --net)
"${isolate[@]}" true 2>/dev/null || { echo "gpu-rehearse: WARNING: cannot unshare the network; running with it"; isolate=(); }
echo "gpu-rehearse: $suite chroot $rootfs, clone of $head, ${env_extra[*]:-default options}, network: ${isolate[*]:-shared}"
t0=$(date +%s)
"${isolate[@]}" chroot "$rootfs" /usr/bin/env -i HOME=/root LANG=C.UTF-8 \
  PATH="$path" OUT=/out "${env_extra[@]}" \
  /bin/bash -c "cd /work/stepcore && tools/gpu-check.sh" 2>&1 | tee "$results/console.log"
rc=${PIPESTATUS[0]}
t1=$(date +%s)
out_files=$(find "$rootfs/out" -type f | wc -l)
(cd "$results" && rm -rf gpu-check.log summary.txt summary.json data.tar.gz data build.log gpu-tests.log \
  bench.log python.log sanitizer.log ./*.json phases.tsv ctest-results.txt)  # an earlier run's
cp "$rootfs"/out/* "$results/" 2>/dev/null
[ -f "$results/data.tar.gz" ] && mkdir -p "$results/data" && tar -xzf "$results/data.tar.gz" -C "$results/data"
if [ "$out_files" -gt "$max_out_files" ]; then
  echo "gpu-rehearse: the check left $out_files files in \$OUT, more than the $max_out_files that come back"
  [ "$rc" -eq 0 ] && rc=1
fi
mib() { awk -v b="$1" 'BEGIN {printf "%.2f MiB", b / 1048576}'; }
{
  echo "rehearsal: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname) ($(nproc) cores), Debian $suite chroot, clone of $head"
  echo "rehearsal: options: ${env_extra[*]:-none}; PATH=$path; network: ${isolate[*]:-shared}"
  echo "rehearsal: tools/gpu-check.sh exit $rc, $((t1 - t0)) s; $out_files files in \$OUT: $(cd "$rootfs/out" && ls | tr '\n' ' ')"
  echo "rehearsal: travels: source tree $(mib "$tree_bytes") + bundle $(mib "$bundle_bytes") = $(mib $((tree_bytes + bundle_bytes))) (limit 64 MiB)"
} | tee "$results/rehearsal.txt"
exit "$rc"
