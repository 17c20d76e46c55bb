#!/usr/bin/env bash
# Run on an ordinary machine with network, before a device check: fetches the .deb files
# of the libraries stepcore builds against into .gpu-bundle/ (ignored by git), so that
# tools/gpu-check.sh can unpack them into a private prefix on an offline, bare GPU
# machine, and checks that the bundle plus the source tree fit the 64 MiB that travel.
#
#   tools/gpu-prepare.sh [--force]     # --force: fetch again even when the bundle exists
#
# What is fetched (Debian's packages of this machine's release; x86-64):
#   GoogleTest + GoogleMock (static libraries, headers, CMake config; GMock because
#   GTest's CMake config refers to its files), Google Benchmark (+ its shared library),
#   xsimd (headers), hwloc (headers, pkg-config file, shared library) and libudev1, which
#   libhwloc needs (unpacked there only when the system has none), pkgconf (the build's
#   pkg_check_modules needs a pkg-config; used there only when the system has none).
# Also carried (python/, pure Python, copied from this machine's Python; optional): nanobind
# (stepcore's Python extension is built with it) and pytest with its dependencies, so the
# check's python phase can build stepcore._core against the GPU machine's torch and run
# python/tests/test_gpu.py -m gpu offline. From STEPCORE_BUNDLE_PYTHON (a site-packages
# folder), else the first python3 / /opt/*/bin/python that imports nanobind.
# Not fetched: Open MPI (the device build runs with STEPCORE_MPI=OFF), libnuma (nothing
# links it: stepcore calls the NUMA system calls itself), NCCL (libnccl.so.2 is
# ~210 MiB; gpu-check.sh finds the GPU machine's own, from the CUDA toolkit or from
# PyTorch's nvidia-nccl wheel), the CUDA toolkit and the compilers (they are there).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
root=$PWD
bundle=$root/.gpu-bundle
limit_mib=64

packages=(
  libgtest-dev libgmock-dev
  libbenchmark-dev libbenchmark1debian
  libxsimd-dev
  libhwloc-dev libhwloc15 libudev1
  pkgconf-bin libpkgconf3
)

die() { echo "gpu-prepare: $*" >&2; exit 1; }

if [ "${1:-}" = "--force" ]; then
  rm -rf "$bundle"
elif [ -n "${1:-}" ]; then
  die "unknown argument '$1' (usage: tools/gpu-prepare.sh [--force])"
fi

command -v apt-get >/dev/null || die "needs apt-get (a Debian or Ubuntu machine)"
command -v dpkg-deb >/dev/null || die "needs dpkg-deb"
# The shared libraries (libbenchmark, libhwloc, pkgconf) need the glibc and libstdc++ of
# the release they come from; the GPU machine's are unknown (Python 3.12.3 there suggests
# Ubuntu 24.04: glibc 2.39). Debian 12's (glibc 2.36, libstdc++ 12) were rehearsed.
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-?}")
if [ "$codename" != bookworm ]; then
  echo "gpu-prepare: WARNING: this is '$codename', not Debian 12 (bookworm): its libraries" \
    "may need a newer glibc than the GPU machine has (docs/gpu-check.md)" >&2
fi

if [ -f "$bundle/MANIFEST" ] && [ "$(ls "$bundle"/*.deb 2>/dev/null | wc -l)" -eq "${#packages[@]}" ]; then
  echo "gpu-prepare: $bundle is already complete (--force fetches again)"
else
  rm -rf "$bundle"
  mkdir -p "$bundle" || die "cannot create $bundle"
  # The GPU machine is x86-64: on another processor, read amd64 package lists into a
  # private folder (nothing of this machine's apt state changes).
  apt_opts=(-o APT::Sandbox::User=root)
  if [ "$(dpkg --print-architecture)" != amd64 ]; then
    lists=/tmp/stepcore-amd64-lists
    mkdir -p "$lists/partial"
    apt_opts+=(-o APT::Architecture=amd64 -o APT::Architectures=amd64 -o Dir::State::Lists="$lists")
    apt-get "${apt_opts[@]}" update -qq || die "apt-get update (amd64 lists) failed"
  fi
  echo "gpu-prepare: apt-get download ${packages[*]}"
  if ! (cd "$bundle" && apt-get "${apt_opts[@]}" download "${packages[@]}"); then
    echo "gpu-prepare: apt-get download failed; trying again after apt-get update" >&2
    apt-get "${apt_opts[@]}" update -qq || die "apt-get update failed (no network?)"
    (cd "$bundle" && apt-get "${apt_opts[@]}" download "${packages[@]}") || die "apt-get download failed"
  fi
  {
    echo "# stepcore device-check bundle: Debian packages for tools/gpu-check.sh"
    echo "# made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME") ($(uname -m))"
    echo "# package version architecture sha256"
    for f in "$bundle"/*.deb; do
      printf '%s %s %s %s\n' "$(dpkg-deb -f "$f" Package)" "$(dpkg-deb -f "$f" Version)" \
        "$(dpkg-deb -f "$f" Architecture)" "$(sha256sum "$f" | cut -d' ' -f1)"
    done
  } >"$bundle/MANIFEST"
fi

# The Python packages the python phase needs, when this machine has them (pure Python).
python_packages=(nanobind pytest _pytest py.py pluggy iniconfig packaging pygments)
find_site_packages() {
  local c d
  if [ -n "${STEPCORE_BUNDLE_PYTHON:-}" ]; then echo "$STEPCORE_BUNDLE_PYTHON"; return 0; fi
  for c in python3 /opt/*/bin/python /opt/*/.venv/bin/python; do
    command -v "$c" >/dev/null 2>&1 || [ -x "$c" ] || continue
    d=$("$c" -c 'import nanobind, os; print(os.path.dirname(os.path.dirname(nanobind.__file__)))' 2>/dev/null) &&
      [ -d "$d/nanobind" ] && { echo "$d"; return 0; }
  done
  return 1
}
if [ ! -d "$bundle/python/nanobind" ]; then
  if site=$(find_site_packages); then
    rm -rf "$bundle/python" && mkdir -p "$bundle/python" || die "cannot create $bundle/python"
    for p in "${python_packages[@]}"; do
      if [ -e "$site/$p" ]; then
        cp -r "$site/$p" "$bundle/python/" || die "cannot copy $site/$p"
        cp -r "$site/${p%.py}"-[0-9]*.dist-info "$bundle/python/" 2>/dev/null
      else
        echo "gpu-prepare: WARNING: $site has no $p (the python phase then needs the GPU machine's)" >&2
      fi
    done
    find "$bundle/python" -name __pycache__ -type d -prune -exec rm -rf {} +
    echo "# from $site on $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$bundle/python/FROM"
    echo "gpu-prepare: Python packages from $site: $(ls "$bundle/python" | grep -v -e dist-info -e FROM | tr '\n' ' ')"
  else
    echo "gpu-prepare: WARNING: no Python with nanobind here (set STEPCORE_BUNDLE_PYTHON):" \
      "the check's python phase will need the GPU machine's nanobind" >&2
  fi
fi

# Every package there, every file a valid x86-64 .deb.
for p in "${packages[@]}"; do
  ls "$bundle/${p}"_*.deb >/dev/null 2>&1 || die "missing from the bundle: $p"
done
for f in "$bundle"/*.deb; do
  arch=$(dpkg-deb -f "$f" Architecture) || die "not a .deb: $f"
  [ "$arch" = amd64 ] || [ "$arch" = all ] || die "$f is for $arch, not amd64"
done

# What travels: tracked files and untracked files git does not ignore, plus the bundle.
bytes_of_tree() {
  { git ls-files -z; git ls-files -z --others --exclude-standard; } |
    xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}'
}
tree_bytes=$(bytes_of_tree)
bundle_bytes=$(du -sb "$bundle" | cut -f1)
total=$((tree_bytes + bundle_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.2f MiB", b / 1048576}'; }
echo "gpu-prepare: bundle $bundle: $(ls "$bundle"/*.deb | wc -l) packages, $(mib "$bundle_bytes")"
echo "gpu-prepare: source tree (git ls-files + untracked, not ignored): $(mib "$tree_bytes")"
echo "gpu-prepare: travels in all: $(mib "$total") of $limit_mib MiB"
if [ "$total" -gt $((limit_mib * 1048576)) ]; then
  die "over the $limit_mib MiB that travel to the device"
fi
echo "gpu-prepare: ready. On the GPU machine run tools/gpu-check.sh with carry [\".gpu-bundle\"]"
