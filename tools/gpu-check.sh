#!/usr/bin/env bash
# The device check, for an offline, bare GPU machine: unpacks .gpu-bundle/ (made by
# tools/gpu-prepare.sh) into a private prefix, builds once (sm_90, Release, no MPI; the
# Python extension too when the machine has a CUDA build of torch) only the CUDA tests,
# benchmarks and programs, and runs the phases in order of value, each within its own
# cap and all within the budget, going on past a failing one: env, unpack, configure,
# build, bench-gpu (the kernels' ratios to a device copy and their host cost per call:
# the figures first), bench-spec (the overlapped full-offload step), gpu-tests (every
# `gpu` test not naming NCCL, per-test timeout), nccl (those naming NCCL but no manager),
# manager-nccl (stepcore-gpu-nccl-step: manager steps with NCCL on one rank against the
# host device, counting the host synchronisations per step, the NCCL norm against a float
# all-reduce; plus the gpu tests naming NCCL and a manager), python
# (python/tests/test_gpu.py -m gpu), bench-comm (when built), sanitizer
# (compute-sanitizer memcheck and racecheck over the kernel tests, with what is left;
# skipped, not failed, where compute-sanitizer refuses the device, as on gVisor hosts).
# CPU-only suites are not run. Four files go to $OUT (else build/gpu-check-logs/; the
# device tool returns at most 8): gpu-check.log (every phase's output, appended as it
# runs, so a check cut short still returns it), summary.txt (the phases and one table of
# figures, tools/gpu_summary.py: "n/a (no device)" where the device gave none),
# summary.json (the same as JSON) and data.tar.gz (the table's inputs: phases.tsv,
# ctest-results.txt and the figures as JSON, bench-gpu.json and nccl-step.json or
# nccl-step-host.json). The summary and the archive are rewritten after every phase; the
# summary is printed last.
# Exit status: 0 when no phase failed, else 1. Without a GPU the CUDA tests skip and every
# phase still runs (tools/gpu-rehearse.sh rehearses it so); with one, a skip is a failure
# (except the sanitizer's, when the sanitizer refuses the device).
#
# Environment (all optional):
#   OUT                       folder for the logs (the device tool sets it)
#   STEPCORE_GPU_BUDGET       seconds the whole check may take (default 420)
#   STEPCORE_TEST_TIMEOUT     ctest's per-test timeout in seconds (default 120)
#   STEPCORE_GPU_PREFIX       where the bundle is unpacked (default /tmp/stepcore-prefix)
#   STEPCORE_GPU_BUILD        build folder (default build/gpu-check)
#   STEPCORE_NCCL_ROOT        folder with include/nccl.h and lib*/libnccl.so* to use
#   STEPCORE_NCCL_SEARCH      where to look for NCCL, in order (default "toolkit system wheel")
#   STEPCORE_GPU_MPI          ON: also build the MPI communicator (needs a system MPI)
#   STEPCORE_SANITIZER        the compute-sanitizer executable
#   STEPCORE_SANITIZER_FILTER gtest filter of the sanitizer runs (default *)
#   STEPCORE_SANITIZER_BUDGET seconds for all the sanitizer runs (default 240; 150 at most each)
#   STEPCORE_UNPACK           dpkg (default when dpkg-deb exists) or ar
#   STEPCORE_GPU_PYTHON       the Python (with a CUDA build of torch) of the python phase
#   STEPCORE_GPU_PHASES       run only these phases (names as in the summary, space-separated;
#                             e.g. "env sanitizer" on a machine that still has the build)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
root=$PWD
outdir=${OUT:-$root/build/gpu-check-logs}
bundle=$root/.gpu-bundle
prefix=${STEPCORE_GPU_PREFIX:-/tmp/stepcore-prefix}
build=${STEPCORE_GPU_BUILD:-$root/build/gpu-check}
# The budget every phase's cap is written for (bounded scales them by budget / it): 7 of
# the lent window's minutes; the rest is the machine's start and the files' return.
default_budget=420
budget=${STEPCORE_GPU_BUDGET:-$default_budget}
test_timeout=${STEPCORE_TEST_TIMEOUT:-120}
jobs=$(nproc 2>/dev/null || echo 4)
# The table's inputs are kept in $logdir (in the build folder) and packed into $outdir.
logdir=$build/gpu-check-data
log=$outdir/gpu-check.log
mkdir -p "$outdir" "$build" "$logdir" || { echo "gpu-check: cannot create $outdir, $build or $logdir" >&2; exit 2; }
rm -f "$outdir"/gpu-check.log "$outdir"/summary.txt "$outdir"/summary.json "$outdir"/data.tar.gz
rm -f "$logdir"/*
: >"$log"
: >"$logdir/ctest-results.txt"
exec 3>&1  # the console, while a phase's output goes to the log
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}  # NCCL's own warnings into the logs

# ---- phases: name, status, seconds, note ------------------------------------------
names=() statuses=() secs=() notes=()
note=""       # a phase function sets it: one line for the summary
have_gpu=0    # set by the env phase
t_start=$SECONDS
deadline=$((t_start + budget))

# say MESSAGE: to the console and to the current phase's log.
say() { echo "$*" >&3; echo "$*"; }

# bounded CAP CMD...: runs CMD with a timeout of CAP seconds (caps are written for the
# default budget and scale with STEPCORE_GPU_BUDGET: a slow rehearsal gets more),
# cut to what the budget leaves (keeping 20 s for the summary); 124 when it timed out or
# no time was left.
bounded() {
  local cap=$(($1 * budget / default_budget)) left t
  shift
  left=$((deadline - SECONDS - 20))
  t=$((cap < left ? cap : left))
  if [ "$t" -lt 5 ]; then
    echo "gpu-check: out of time (budget ${budget}s) before: $*"
    return 124
  fi
  timeout -k 10 "$t" "$@"
}

# echoed CAP CMD...: bounded CMD, its output to the log as it comes and to the console
# once it ends (and kept in $echoed_out until the next call); returns CMD's status.
echoed_out=$(mktemp)
trap 'rm -f "$echoed_out"' EXIT
echoed() {
  local rc
  bounded "$@" 2>&1 | tee "$echoed_out"
  rc=${PIPESTATUS[0]}
  cat "$echoed_out" >&3
  return "$rc"
}
# device_skipped: the last echoed program said it found no CUDA device.
device_skipped() { grep -qiE 'skip(ped)?[:,] no CUDA device' "$echoed_out"; }

# phase NAME FUNCTION: runs FUNCTION with its output appended to the log. FUNCTION
# returns 0 (pass), 3 (skip: it could not run; a failure when a GPU is present), 5 (skip
# even with a GPU: a tool refused this device, said in the note), 4 (n/a: not part of
# this build, never a failure) or anything else (fail). Then the summary and the archive
# in $outdir are brought up to date.
phase() {
  local name=$1 fn=$2 t0=$SECONDS rc status first
  [ -z "${STEPCORE_GPU_PHASES:-}" ] || [[ " $STEPCORE_GPU_PHASES " == *" $name "* ]] || return 0
  first=$(($(wc -l <"$log") + 1))
  note=""
  echo "==> $name" >&3
  { echo; echo "==> $name ($(date -u +%H:%M:%S))"; } >>"$log"
  "$fn" >>"$log" 2>&1
  rc=$?
  case $rc in
    0) status=pass ;;
    3) if [ "$have_gpu" = 1 ]; then status=FAIL; note="skipped with a GPU present: $note"; else status=skip; fi ;;
    4) status=n/a ;;
    5) status=skip ;;
    *) status=FAIL ;;
  esac
  names+=("$name") statuses+=("$status") secs+=($((SECONDS - t0))) notes+=("$note")
  echo "<== $name: $status ($((SECONDS - t0)) s) $note" | tee -a "$log" >&3
  if [ "$status" = FAIL ]; then
    echo "---- last lines of $name (full log: $(basename "$log")) ----" >&3
    tail -n +"$first" "$log" | tail -n 25 >&3
    echo "----" >&3
  fi
  write_summary "after $name" >/dev/null
}

# ---- env: what the machine has ----------------------------------------------------------
nvcc=""
# find_pip_tool NAME MODULE: puts on PATH the folder of NAME from PyPI's wheel (module
# MODULE's BIN_DIR / CMAKE_BIN_DIR) or a venv's bin, when NAME is not on PATH.
find_pip_tool() {
  local name=$1 module=$2 py d
  command -v "$name" >/dev/null && return 0
  for py in "${STEPCORE_GPU_PYTHON:-}" python3 /opt/*/.venv/bin/python /opt/*/bin/python; do
    [ -n "$py" ] || continue
    command -v "$py" >/dev/null || [ -x "$py" ] || continue
    d=$("$py" -c "import $module as m; print(getattr(m, 'CMAKE_BIN_DIR', None) or getattr(m, 'BIN_DIR'))" 2>/dev/null)
    if [ -n "$d" ] && [ -x "$d/$name" ]; then PATH=$d:$PATH; echo "$name: PyPI's wheel at $d"; return 0; fi
  done
  for d in "$HOME"/.local/bin /opt/*/.venv/bin /opt/*/bin; do
    [ -x "$d/$name" ] && { PATH=$PATH:$d; echo "$name: $d"; return 0; }
  done
  return 1
}
phase_env() {
  find_pip_tool cmake cmake || echo "cmake: not found (not on PATH, not from pip)"
  find_pip_tool ninja ninja || echo "ninja: not found (not on PATH, not from pip)"
  export PATH
  echo "date:    $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host:    $(uname -srm), $(. /etc/os-release 2>/dev/null && echo "${PRETTY_NAME:-?}"), $jobs cores"
  echo "glibc:   $(ldd --version 2>/dev/null | head -1)"
  echo "c++:     $(c++ --version 2>/dev/null | head -1)"
  echo "cmake:   $(cmake --version 2>/dev/null | head -1) ($(command -v cmake))"
  echo "ninja:   $(ninja --version 2>/dev/null) ($(command -v ninja))"
  echo "python3: $(python3 --version 2>/dev/null) ($(command -v python3))"
  nvcc=$(command -v nvcc || true)
  [ -n "$nvcc" ] || for c in /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
    [ -x "$c" ] && { nvcc=$c; break; }
  done
  if [ -n "$nvcc" ]; then
    echo "nvcc:    $("$nvcc" --version | tail -n 2 | head -1) ($nvcc)"
  else
    echo "nvcc:    not found"
  fi
  # MPI is not built here (STEPCORE_GPU_MPI=ON would try): say what there is, for next time.
  echo "mpi:     mpicc $(command -v mpicc || echo none), mpirun $(command -v mpirun || echo none);" \
    "mpi4py: $(python3 -c 'import mpi4py, mpi4py.MPI as M; print(mpi4py.__version__, M.Get_library_version().splitlines()[0])' 2>/dev/null || echo none)"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,pci.bus_id,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
      --format=csv 2>&1
    if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then have_gpu=1; fi
  else
    echo "nvidia-smi: not found"
  fi
  if [ "$have_gpu" = 1 ]; then
    say "gpu-check: GPU present: every gpu test must run (a skip is a failure)"
    note="GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
  else
    say "gpu-check: NO GPU: the CUDA tests skip (a rehearsal)"
    note="no GPU"
  fi
  [ -n "$nvcc" ] || { note="no nvcc: the CUDA parts cannot be built"; return 1; }
}

# ---- unpack: the bundle into a private prefix -------------------------------------------
pkgconfig_exe="" libdir="" unpacked=0
unpack_deb() {  # unpack_deb FILE DEST: dpkg-deb -x, or ar + tar where there is no dpkg
  local deb=$1 dest=$2 tmp data
  if [ "${STEPCORE_UNPACK:-dpkg}" = dpkg ] && command -v dpkg-deb >/dev/null; then
    dpkg-deb -x "$deb" "$dest"
    return
  fi
  tmp=$(mktemp -d) || return 1
  (cd "$tmp" && ar x "$deb") || { rm -rf "$tmp"; return 1; }
  data=$(ls "$tmp"/data.tar* 2>/dev/null | head -1)
  case $data in
    *.zst) zstd -dc "$data" | tar -x -C "$dest" ;;
    *) tar -xf "$data" -C "$dest" ;;
  esac
  local rc=$?
  rm -rf "$tmp"
  return $rc
}
phase_unpack() {
  if ! ls "$bundle"/*.deb >/dev/null 2>&1; then
    note="no .gpu-bundle/: using the system's packages (run tools/gpu-prepare.sh and carry .gpu-bundle)"
    echo "$note"
    command -v pkg-config >/dev/null && pkgconfig_exe=$(command -v pkg-config)
    return 0
  fi
  rm -rf "$prefix" && mkdir -p "$prefix" || return 1
  local f n=0 base system_udev=0
  PATH=$PATH:/sbin:/usr/sbin ldconfig -p 2>/dev/null | grep -q 'libudev\.so\.1 ' && system_udev=1
  for f in /lib/x86_64-linux-gnu/libudev.so.1 /usr/lib/x86_64-linux-gnu/libudev.so.1 /usr/lib64/libudev.so.1; do
    [ -e "$f" ] && system_udev=1
  done
  for f in "$bundle"/*.deb; do
    base=$(basename "$f")
    if [ "${base%%_*}" = libudev1 ] && [ "$system_udev" = 1 ]; then
      echo "kept the system's libudev.so.1 (not unpacking $base)"
      continue
    fi
    unpack_deb "$f" "$prefix" || { note="cannot unpack $base"; return 1; }
    n=$((n + 1))
  done
  # The .pc files name /usr: point them at the prefix.
  local pc
  for pc in "$prefix"/usr/lib/*/pkgconfig/*.pc "$prefix"/usr/share/pkgconfig/*.pc; do
    [ -f "$pc" ] && sed -i -E "s#^(prefix|exec_prefix|libdir|includedir)=/usr#\1=$prefix/usr#" "$pc"
  done
  libdir=$(ls -d "$prefix"/usr/lib/x86_64-linux-gnu 2>/dev/null || echo "$prefix/usr/lib")
  export PKG_CONFIG_PATH="$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
  export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # Debian keeps arch-specific headers (hwloc/autogen/config.h) in a multiarch folder
  # that the system compiler searches only under /usr: add the prefix's.
  if [ -d "$prefix/usr/include/x86_64-linux-gnu" ]; then
    export CPATH="$prefix/usr/include/x86_64-linux-gnu${CPATH:+:$CPATH}"
  fi
  if command -v pkg-config >/dev/null; then
    pkgconfig_exe=$(command -v pkg-config)
  else
    pkgconfig_exe=$prefix/usr/bin/pkgconf
    echo "no pkg-config on the system: using the bundle's $pkgconfig_exe"
  fi
  "$pkgconfig_exe" --modversion hwloc >/dev/null || { note="pkg-config cannot read hwloc.pc"; return 1; }
  unpacked=1
  note="$n packages into $prefix (hwloc $("$pkgconfig_exe" --modversion hwloc), pkg-config: $pkgconfig_exe)"
  echo "$note"
}

# ---- configure: NCCL from what the machine has, then cmake ---------------------------
nccl_inc="" nccl_lib=""
nccl_try() {  # nccl_try ROOT: sets nccl_inc/nccl_lib when ROOT has both
  local r=$1 l
  [ -f "$r/include/nccl.h" ] || return 1
  for l in "$r"/lib64/libnccl.so "$r"/lib/libnccl.so "$r"/lib/x86_64-linux-gnu/libnccl.so \
    "$r"/lib64/libnccl.so.2 "$r"/lib/libnccl.so.2 "$r"/lib/x86_64-linux-gnu/libnccl.so.2; do
    if [ -e "$l" ]; then nccl_inc=$r/include nccl_lib=$l; return 0; fi
  done
  return 1
}
find_nccl() {
  if [ -n "${STEPCORE_NCCL_ROOT:-}" ]; then
    nccl_try "$STEPCORE_NCCL_ROOT" && { echo "NCCL: STEPCORE_NCCL_ROOT"; return 0; }
    echo "NCCL: STEPCORE_NCCL_ROOT=$STEPCORE_NCCL_ROOT has no include/nccl.h + libnccl.so"
    return 1
  fi
  local where d
  for where in ${STEPCORE_NCCL_SEARCH:-toolkit system wheel}; do
    case $where in
      toolkit) nccl_try "$(dirname "$(dirname "$(readlink -f "$nvcc")")")" && { echo "NCCL: the CUDA toolkit's"; return 0; } ;;
      system) nccl_try /usr && { echo "NCCL: the system's (/usr)"; return 0; } ;;
      wheel)
        # PyTorch's nvidia-nccl wheel: ask python3, then look where venvs usually are.
        for d in $(python3 -c 'import importlib.util as u; s = u.find_spec("nvidia.nccl"); print(*(s.submodule_search_locations or []))' 2>/dev/null) \
          /opt/*/.venv/lib/python3*/site-packages/nvidia/nccl /opt/*/lib/python3*/site-packages/nvidia/nccl \
          /usr/local/lib/python3*/dist-packages/nvidia/nccl /usr/lib/python3/dist-packages/nvidia/nccl \
          "$HOME"/.local/lib/python3*/site-packages/nvidia/nccl; do
          nccl_try "$d" && { echo "NCCL: the nvidia-nccl wheel at $d"; return 0; }
        done ;;
    esac
  done
  return 1
}
phase_configure() {
  [ -n "$nvcc" ] || { note="no nvcc"; return 1; }
  local args=(
    -S "$root" -B "$build" -G Ninja
    -DCMAKE_BUILD_TYPE=Release
    -DSTEPCORE_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90
    -DSTEPCORE_TESTS=ON -DSTEPCORE_BENCH=ON -DSTEPCORE_TOOLS=ON
    -DSTEPCORE_MPI="${STEPCORE_GPU_MPI:-OFF}"
  )
  if [ "$unpacked" = 1 ]; then
    args+=(-DCMAKE_PREFIX_PATH="$prefix/usr")
    local cm=$libdir/cmake
    [ -d "$cm/GTest" ] && args+=(-DGTest_DIR="$cm/GTest")
    [ -d "$cm/benchmark" ] && args+=(-Dbenchmark_DIR="$cm/benchmark")
  fi
  [ -n "$pkgconfig_exe" ] && args+=(-DPKG_CONFIG_EXECUTABLE="$pkgconfig_exe")
  # One build: the Python extension in it when the machine's torch is a CUDA build.
  if python_ready; then
    args+=(-DSTEPCORE_PYTHON=ON -DPython_EXECUTABLE="$py_exe")
    echo "python: $py_note"
  else
    args+=(-DSTEPCORE_PYTHON=OFF)
    echo "python: off ($py_note)"
  fi
  if find_nccl; then
    local v
    v=$(awk '/^#define NCCL_(MAJOR|MINOR|PATCH) /{printf "%s%s", sep, $3; sep="."}' "$nccl_inc/nccl.h")
    echo "NCCL $v: $nccl_inc/nccl.h, $nccl_lib ($(du -Lh "$nccl_lib" | cut -f1))"
    args+=(-DSTEPCORE_NCCL=ON -DSTEPCORE_NCCL_INCLUDE="$nccl_inc" -DSTEPCORE_NCCL_LIBRARY="$nccl_lib")
    export LD_LIBRARY_PATH="$(dirname "$nccl_lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    note="NCCL $v from $(dirname "$nccl_lib")"
  else
    say "gpu-check: WARNING: NO NCCL FOUND (searched: ${STEPCORE_NCCL_SEARCH:-toolkit system wheel}): building WITHOUT the NCCL communicator; the nccl and manager-nccl phases will fail"
    args+=(-DSTEPCORE_NCCL=OFF)
    note="NO NCCL: built without the NCCL communicator"
  fi
  echo "cmake ${args[*]}"
  bounded 120 cmake "${args[@]}" || { note="cmake failed; $note"; return 1; }
}

# ---- build: only what the phases run ------------------------------------------------------
gpu_tests=()
has_target() { grep -q "/CMakeFiles/$1\.dir\$" "$build/CMakeFiles/TargetDirectories.txt" 2>/dev/null; }
phase_build() {
  [ -f "$build/build.ninja" ] || { note="not configured"; return 1; }
  # The gpu-labelled suites, as tests/CMakeLists.txt declares them.
  local t targets=()
  gpu_tests=()
  for t in $(sed -nE 's/^[[:space:]]*stepcore_add_test\(([A-Za-z0-9_]+)[[:space:]]+LABEL[[:space:]]+gpu\b.*/\1/p' "$root/tests/CMakeLists.txt" | sort -u); do
    has_target "$t" && gpu_tests+=("$t")
  done
  targets=("${gpu_tests[@]}")
  for t in stepcore-bench-gpu stepcore-bench-speculation stepcore-bench-comm stepcore-gpu-nccl-step \
    _core stepcore_python_files; do
    has_target "$t" && targets+=("$t")
  done
  echo "targets: ${targets[*]}"
  # -k 0: build every target that can be built, so one broken file costs only its phase.
  bounded 200 cmake --build "$build" --parallel "$jobs" --target "${targets[@]}" -- -k 0
  local rc=$? missing=()
  for t in "${targets[@]}"; do
    case $t in _core | stepcore_python_files) continue ;; esac  # checked by the python phase
    [ -x "$(find "$build" -name "$t" -type f -perm -u+x -print -quit)" ] || missing+=("$t")
  done
  if [ $rc -ne 0 ] || [ ${#missing[@]} -gt 0 ]; then
    note="build failed (rc $rc); not built: ${missing[*]:-none}"
    return 1
  fi
  note="${#targets[@]} targets: ${targets[*]}"
}

# ---- the ctest phases -----------------------------------------------------------------
# run_ctest ARGS...: the gpu-labelled tests selected by ARGS; sets note to the counts.
run_ctest() {
  local out rc total failed skipped
  out=$(mktemp)
  bounded $((test_timeout * 4 + 60)) ctest --test-dir "$build" -L gpu --timeout "$test_timeout" \
    --output-on-failure --no-tests=error "$@" 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  # "100% tests passed, 0 tests failed out of 18" (CMake 3) or "... passed out of 18" (4).
  total=$(sed -nE 's/.*% tests passed.* out of ([0-9]+).*/\1/p' "$out" | tail -1)
  failed=$(sed -nE 's/.*% tests passed.* ([0-9]+) tests? failed out of.*/\1/p' "$out" | tail -1)
  [ -n "$total" ] && [ -z "$failed" ] && failed=0
  skipped=$(grep -cE '\(Skipped\)$' "$out")
  # Each test's verdict, for the summary's bitwise rows: "NAME passed|failed|skipped".
  sed -nE 's/.*Test +#[0-9]+: ([^ ]+) \.+ *\*{0,3}(Passed|Failed|Skipped|Not Run|Timeout|Exception).*/\1 \2/p' "$out" |
    awk '{ $NF = tolower($NF); print }' >>"$logdir/ctest-results.txt"
  local skipped_names
  skipped_names=$(sed -nE 's/^[[:space:]]*[0-9]+ - ([^ ]+) \(Skipped\)$/\1/p' "$out" | head -3 | tr '\n' ' ')
  grep -E 'tests passed|\(Failed\)|\(Timeout\)|\(Subprocess|\*\*\*Exception|No tests were found' "$out" >&3
  rm -f "$out"
  note="${total:-0} tests, ${failed:-?} failed, $skipped skipped"
  [ $rc -eq 124 ] && note="$note; TIMED OUT"
  [ $rc -eq 0 ] || return 1
  if [ "$skipped" -gt 0 ] && [ "$have_gpu" = 1 ]; then note="$note (a skip with a GPU present: ${skipped_names}...)"; return 1; fi
  [ "$have_gpu" = 1 ] || note="$note (no GPU)"
  return 0
}
phase_gpu_tests() { run_ctest -E '[Nn]ccl|NCCL'; }
# The gpu tests split three ways by name: NCCL's and the managers' with NCCL
# (Nccl*.*Manager*), the communicator's other NCCL tests, and all the rest.
mgr_nccl_re='Manager.*([Nn]ccl|NCCL)|([Nn]ccl|NCCL).*Manager'
phase_nccl() {
  has_target test_comm_nccl || { note="test_comm_nccl not built: no NCCL"; return 1; }
  run_ctest -R '[Nn]ccl|NCCL' -E "$mgr_nccl_re"
}
phase_manager_nccl() {
  local exe=$build/tools/stepcore-gpu-nccl-step rc
  [ -x "$exe" ] || { note="stepcore-gpu-nccl-step not built (NCCL missing or build failed)"; return 1; }
  echoed 60 "$exe" --json "$logdir/nccl-step.json"
  rc=$?
  note="stepcore-gpu-nccl-step rc $rc"
  [ $rc -eq 0 ] || return 1
  if [ "$have_gpu" = 1 ] && device_skipped; then note="$note, but it found no CUDA device"; return 1; fi
  if [ "$have_gpu" = 0 ]; then
    # No GPU: check the program's manager steps with the host device and an in-process
    # communicator instead, so that the rehearsal runs them.
    echoed 120 "$exe" --host --json "$logdir/nccl-step-host.json"
    rc=$?
    note="$note (no GPU: skipped); --host self-check rc $rc"
    [ $rc -eq 0 ] || return 1
  fi
  # The gpu tests of a manager with NCCL (e.g. NcclGate.TheManagersWaits...).
  if ctest --test-dir "$build" -L gpu -N -R "$mgr_nccl_re" 2>/dev/null | grep -q 'Test *#'; then
    local n=$note
    run_ctest -R "$mgr_nccl_re" || { note="$n; tests: $note"; return 1; }
    note="$n; tests: $note"
  fi
  return 0
}

# ---- python: stepcore.gpu on torch CUDA tensors (python/tests/test_gpu.py -m gpu) ------
# The machine's Python whose torch is a CUDA build; nanobind and pytest from it, else from
# .gpu-bundle/python (tools/gpu-prepare.sh). The extension is built in the one build.
py_exe="" py_note=""
find_torch_python() {
  local c
  for c in "${STEPCORE_GPU_PYTHON:-}" "$(command -v python3)" "$(command -v python)" \
    /opt/*/.venv/bin/python /opt/*/bin/python /opt/*/venv/bin/python "$HOME"/.venv/bin/python; do
    [ -n "$c" ] && [ -x "$c" ] || continue
    if "$c" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' >/dev/null 2>&1; then
      py_exe=$c
      return 0
    fi
  done
  return 1
}
# python_ready: sets py_exe and py_note; true when the extension can be built and tested.
python_ready() {
  find_torch_python || { py_note="no Python with a CUDA build of torch (STEPCORE_GPU_PYTHON)"; return 1; }
  local bundled=$bundle/python pypath="" m missing=() torch_v
  torch_v=$("$py_exe" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)' 2>&1)
  for m in nanobind pytest numpy; do
    if ! "$py_exe" -c "import $m" >/dev/null 2>&1; then
      if [ -d "$bundled" ] && PYTHONPATH=$bundled "$py_exe" -c "import $m" >/dev/null 2>&1; then
        pypath=$bundled
      else
        missing+=("$m")
      fi
    fi
  done
  if [ ${#missing[@]} -gt 0 ]; then
    py_note="$py_exe lacks ${missing[*]} (tools/gpu-prepare.sh carries nanobind and pytest in .gpu-bundle/python)"
    return 1
  fi
  if ! "$py_exe" -c 'import os, sysconfig, sys; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)'; then
    py_note="$py_exe has no Python.h (no development headers)"
    return 1
  fi
  # The bundle's packages after the machine's own (cmake finds nanobind through it too).
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$pypath
  py_note="$py_exe ($("$py_exe" --version 2>&1)), torch $torch_v${pypath:+, nanobind/pytest from the bundle}"
  return 0
}
phase_python() {
  [ -n "$py_exe" ] && [ -f "$build/python/stepcore/__init__.py" ] ||
    { note="not built: ${py_note:-the extension is not in this build}"; echo "$note"; return 4; }
  ls "$build"/python/stepcore/_core*.so >/dev/null 2>&1 || { note="stepcore._core was not built (see the build phase in gpu-check.log)"; return 1; }
  local out rc passed skipped failed
  echo "python: $py_note"
  out=$(mktemp)
  (cd /tmp && bounded 90 env PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" \
    "$py_exe" -m pytest -q -p no:cacheprovider -m gpu -rs "$root/python/tests/test_gpu.py") 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  passed=$(grep -oE '[0-9]+ passed' "$out" | tail -1 | cut -d' ' -f1)
  skipped=$(grep -oE '[0-9]+ skipped' "$out" | tail -1 | cut -d' ' -f1)
  failed=$(grep -oE '[0-9]+ (failed|error)' "$out" | awk '{s += $1} END {print s + 0}')
  grep -E 'passed|failed|error|SKIPPED' "$out" | tail -n 5 >&3
  rm -f "$out"
  note="${passed:-0} passed, ${failed:-0} failed, ${skipped:-0} skipped"
  [ "$rc" -eq 124 ] && note="$note; TIMED OUT"
  [ "$rc" -eq 0 ] || return 1
  if [ "${skipped:-0}" -gt 0 ]; then
    [ "$have_gpu" = 1 ] && { note="$note: a skip with a GPU present"; return 1; }
    note="$note (no GPU)"
  fi
  return 0
}

# ---- compute-sanitizer over the kernel tests --------------------------------------------
find_sanitizer() {
  local c
  for c in "${STEPCORE_SANITIZER:-}" "$(command -v compute-sanitizer)" \
    "$(dirname "$nvcc")/compute-sanitizer" "$(dirname "$(dirname "$nvcc")")/compute-sanitizer/compute-sanitizer" \
    /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}
# refused_device FILE: the sanitizer's output says it cannot run on this device: "Device
# not supported", or the CUDA runtime's error 999 (cudaErrorUnknown, as at the first
# allocation where the sanitizer refused a gVisor host's device) with no memory or race
# report beside it.
refused_device() {
  grep -qi 'device not supported' "$1" && return 0
  grep -qE 'cudaErrorUnknown|error 999|\(999\)|code=999' "$1" &&
    ! grep -qE '^=+ +(Invalid |Uninitialized |.*[Rr]ace reported|.*[Hh]azard)' "$1"
}
phase_sanitizer() {
  local san tool t exe rc runs=0 bad=0 nodriver=0 refused="" what=() cap out
  local stop=$((SECONDS + ${STEPCORE_SANITIZER_BUDGET:-240}))
  san=$(find_sanitizer) || { note="compute-sanitizer not found"; return 3; }
  echo "compute-sanitizer: $san ($("$san" --version 2>&1 | grep -i version | head -1))"
  out=$(mktemp)
  for tool in memcheck racecheck; do
    local list="test_gpu_kernels test_gpu_steps test_gpu_conversions test_cuda_device"
    [ $tool = racecheck ] && list="test_gpu_kernels test_gpu_steps"
    for t in $list; do
      exe=$build/tests/$t
      runs=$((runs + 1))
      [ -x "$exe" ] || { say "sanitizer: $t not built"; bad=$((bad + 1)); what+=("$t:not-built"); continue; }
      cap=$((stop - SECONDS))
      [ $cap -gt 150 ] && cap=150
      echo "---- $tool $t (at most ${cap} s)"
      if [ $cap -lt 10 ]; then
        say "sanitizer: $tool $t: no time left (STEPCORE_SANITIZER_BUDGET)"; bad=$((bad + 1)); what+=("$tool:$t:no-time")
        continue
      fi
      bounded "$cap" "$san" --tool "$tool" --error-exitcode 99 --print-limit 20 "$exe" \
        --gtest_filter="${STEPCORE_SANITIZER_FILTER:-*}" --gtest_brief=1 >"$out" 2>&1
      rc=$?
      cat "$out"
      if [ $rc -ne 0 ] && refused_device "$out"; then
        # The tool cannot run on this device (a gVisor host): no later run can either.
        refused=$(grep -m1 -ioE 'device not supported|cudaErrorUnknown|error 999' "$out" | head -1)
        say "sanitizer: $tool $t: compute-sanitizer refused this device ($refused): the phase is skipped"
        break 2
      fi
      if [ $rc -ne 0 ] && [ "$have_gpu" = 0 ] && grep -q 'terminated before first instrumented API call' "$out"; then
        # No driver: the sanitizer cannot attach; the command line and the binary were found.
        say "sanitizer: $tool $t: cannot instrument without a GPU driver (expected here)"
        nodriver=$((nodriver + 1))
        continue
      fi
      case $rc in
        0) say "sanitizer: $tool $t: clean ($(grep -m1 'ERROR SUMMARY\|RACECHECK SUMMARY' "$out" | sed 's/^=* *//'))" ;;
        99) say "sanitizer: $tool $t: ERRORS found"; grep -m3 -E '^=+ +(Invalid|Race|Error|ERROR)' "$out" >&3
            bad=$((bad + 1)); what+=("$tool:$t:errors") ;;
        124) say "sanitizer: $tool $t: TIMED OUT after ${cap} s"; bad=$((bad + 1)); what+=("$tool:$t:timeout") ;;
        *) say "sanitizer: $tool $t: exit $rc (a test failed under the sanitizer, or it could not run)"
           bad=$((bad + 1)); what+=("$tool:$t:rc$rc") ;;
      esac
    done
  done
  rm -f "$out"
  if [ -n "$refused" ]; then
    note="compute-sanitizer refused the device ($refused) at run $runs: skipped, not failed"
    [ $bad -eq 0 ] && return 5
    note="$note; before it: ${what[*]}"
    return 1
  fi
  note="$((runs - bad - nodriver))/$runs runs clean${what[*]:+: ${what[*]}}"
  if [ $nodriver -gt 0 ]; then
    note="$note; $nodriver could not instrument (no driver)"
    [ $bad -eq 0 ] && [ $nodriver -eq $runs ] && return 3
  fi
  [ $bad -eq 0 ]
}

# ---- benchmarks ------------------------------------------------------------------------------
# program_phase EXE SECONDS MISSING_STATUS MISSING_NOTE: runs a built program for at most
# SECONDS; a program that is not built gives MISSING_STATUS with MISSING_NOTE. With a GPU
# present, a program that reports no CUDA device fails.
program_phase() {
  local exe=$1 limit=$2 rc
  [ -x "$exe" ] || { note=$4; return "$3"; }
  shift 4
  echoed "$limit" "$exe" "$@"
  rc=$?
  note="rc $rc"
  [ "$have_gpu" = 1 ] || note="$note (no GPU: skipped)"
  if [ "$have_gpu" = 1 ] && device_skipped; then note="$note, but it found no CUDA device"; return 1; fi
  [ $rc -eq 0 ]
}
phase_bench_gpu() {
  local exe=$build/bench/stepcore-bench-gpu
  [ -x "$exe" ] || { note="stepcore-bench-gpu not built"; return 1; }
  program_phase "$exe" 60 1 "" --json "$logdir/bench-gpu.json"
}
# The overlapped full-offload step on the CUDA device (copies are DMA; device staging on):
# the overlapped step's exposed-time targets.
phase_bench_speculation() {
  local exe=$build/bench/stepcore-bench-speculation
  [ -x "$exe" ] || { note="stepcore-bench-speculation not built"; return 1; }
  echoed 75 "$exe" 50 3 cuda on
  local rc=$?
  note="rc $rc"
  grep -q 'targets: [0-9]* missed' "$echoed_out" && note="$note; $(grep -o 'targets: [0-9]* missed' "$echoed_out" | head -1)"
  [ "$have_gpu" = 1 ] || note="$note (no GPU: skipped)"
  if [ "$have_gpu" = 1 ] && device_skipped; then note="$note, but it found no CUDA device"; return 1; fi
  [ $rc -eq 0 ]
}
phase_bench_comm() {
  program_phase "$build/bench/stepcore-bench-comm" 120 4 "not built (it needs MPI: STEPCORE_GPU_MPI=ON)"
}

# ---- the summary: the table to $outdir/summary.txt, its JSON, the inputs' archive -------
# write_summary STATE: the phases so far ("after PHASE", or "final") and the figures; the
# result line says FAIL, PASS or, before the end, INCOMPLETE. Prints the summary.
write_summary() {
  local state=$1 worst=0 i s result py f inputs=()
  for s in "${statuses[@]}"; do [ "$s" = FAIL ] && worst=1; done
  for i in "${!names[@]}"; do
    printf '%s\t%s\t%s\t%s\n' "${names[$i]}" "${statuses[$i]}" "${secs[$i]}" "${notes[$i]}"
  done >"$logdir/phases.tsv"
  if [ $worst -ne 0 ]; then result=FAIL; elif [ "$state" = final ]; then result=PASS; else result="INCOMPLETE ($state)"; fi
  {
    echo "gpu-check summary, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(hostname 2>/dev/null || echo ?), total $((SECONDS - t_start)) s of ${budget} s"
    printf '%-13s %-6s %5s  %s\n' phase status secs note
    for i in "${!names[@]}"; do
      printf '%-13s %-6s %5s  %s\n' "${names[$i]}" "${statuses[$i]}" "${secs[$i]}" "${notes[$i]}"
    done
    # The figures, one table (and summary.json): needs a python3 (any: the standard library).
    py=$(command -v python3 || echo "$py_exe")
    if [ -n "$py" ] && "$py" "$root/tools/gpu_summary.py" "$logdir" "$have_gpu"; then
      cp "$logdir/summary.json" "$outdir/summary.json.tmp" && mv -f "$outdir/summary.json.tmp" "$outdir/summary.json"
    else
      echo "figures: no python3 to read the JSON files (they are in data.tar.gz)"
    fi
    for f in "$logdir"/*; do
      [ -f "$f" ] && [ "${f##*/}" != summary.json ] && inputs+=("${f##*/}")
    done
    echo "result: $result (in $outdir: gpu-check.log summary.txt summary.json data.tar.gz of ${inputs[*]})"
  } >"$outdir/summary.txt.tmp"
  mv -f "$outdir/summary.txt.tmp" "$outdir/summary.txt"
  # The inputs in one archive (gzip where there is one), replaced whole.
  (cd "$logdir" && { tar -czf "$outdir/data.tar.gz.tmp" "${inputs[@]}" 2>/dev/null ||
    tar -cf "$outdir/data.tar.gz.tmp" "${inputs[@]}"; }) && mv -f "$outdir/data.tar.gz.tmp" "$outdir/data.tar.gz"
  cat "$outdir/summary.txt"
  return $worst
}

# ---- run: the figures first, the sanitizers with what is left ---------------------------
echo "gpu-check: $root -> $outdir (gpu-check.log, summary.txt, summary.json, data.tar.gz), build in $build, budget ${budget}s, $jobs jobs"
phase env phase_env
phase unpack phase_unpack
phase configure phase_configure
phase build phase_build
phase bench-gpu phase_bench_gpu
phase bench-spec phase_bench_speculation
phase gpu-tests phase_gpu_tests
phase nccl phase_nccl
phase manager-nccl phase_manager_nccl
phase python phase_python
phase bench-comm phase_bench_comm
phase sanitizer phase_sanitizer  # last: the slowest, cut to what the budget leaves

write_summary final
exit $?
