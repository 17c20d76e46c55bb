#!/usr/bin/env bash
# The sanitizer half of CI (.ci/run runs it after the README's test command): the asan
# preset (clang's AddressSanitizer + UndefinedBehaviorSanitizer) over every unit and mpi
# test, the tsan preset (ThreadSanitizer with LLVM's libomp and its Archer tool) over the
# threaded suites (CPU engine, host device, managers, communicators), both under the quick
# test profile (tests/isa_list.hpp: every case, fewer repeated steps), and the libFuzzer
# harnesses of the same asan build (it carries libFuzzer's coverage instrumentation) for
# STEPCORE_FUZZ_SECONDS each (default 30 here; tools/run-fuzz.sh does the long runs) from
# the committed corpus. CPU only. Prints each phase's duration; exits non-zero at the
# first failure.
#
#   tools/run-sanitizers.sh [asan] [tsan] [fuzz]     (default: all three)
set -euo pipefail
cd "$(dirname "$0")/.."
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(asan tsan fuzz)
jobs=$(nproc 2>/dev/null || echo 2)
tools/install-deps.sh --sanitizers

# The threaded suites TSan runs (their test binaries; every test in them).
tsan_targets=(test_cpu_engine test_device test_comm test_gpu_manager test_offload_manager
              test_managers test_trainer_api test_speculation test_offload_timeout)

timed() {  # timed NAME COMMAND...: runs the command and prints how long it took
  local name=$1 start=$SECONDS
  shift
  echo "== $name"
  "$@"
  echo "== $name: $((SECONDS - start)) s"
}

fuzz_seconds=${STEPCORE_FUZZ_SECONDS:-30}
harnesses=(fuzz_norm fuzz_checkpoint fuzz_engine fuzz_manager fuzz_safetensors)

asan() {  # builds everything, the fuzz harnesses included; runs the unit and mpi tests
  cmake --preset asan -DSTEPCORE_PYTHON=OFF -DSTEPCORE_FUZZ_SECONDS="$fuzz_seconds" >/dev/null
  cmake --build --preset asan -j "$jobs"
  STEPCORE_TEST_PROFILE=quick ctest --preset asan -L 'unit|mpi' -j "$jobs"
}

tsan() {
  cmake --preset tsan -DSTEPCORE_PYTHON=OFF -DSTEPCORE_MPI=OFF -DSTEPCORE_TOOLS=OFF >/dev/null
  cmake --build --preset tsan -j "$jobs" --target "${tsan_targets[@]}"
  # The gtest suites of the binaries built here (the preset's other tests are not built).
  local suites=()
  for t in "${tsan_targets[@]}"; do
    while IFS= read -r s; do suites+=("$s"); done < <(
      build/tsan/tests/"$t" --gtest_list_tests | awk '/^[A-Za-z_][A-Za-z0-9_\/]*\.( |$)/ { sub(/\..*/, ""); print }')
  done
  # The quick profile (tests/isa_list.hpp): every case at fewer repeated steps.
  STEPCORE_TEST_PROFILE=quick ctest --preset tsan -R "^($(IFS='|'; echo "${suites[*]}"))\\." -j "$jobs"
}

fuzz() {  # the asan build's harnesses (built here if the asan phase did not run)
  cmake --preset asan -DSTEPCORE_PYTHON=OFF -DSTEPCORE_FUZZ_SECONDS="$fuzz_seconds" >/dev/null
  cmake --build --preset asan -j "$jobs" --target "${harnesses[@]}"
  ctest --preset asan-fuzz
}

for p in "${phases[@]}"; do
  case $p in
    asan|tsan|fuzz) timed "$p" "$p" ;;
    *) echo "run-sanitizers: unknown phase '$p' (asan, tsan, fuzz)" >&2; exit 2 ;;
  esac
done
