#!/usr/bin/env bash
# The emulated aarch64 part of the test command (tools/run-tests.sh runs it last): builds
# the `aarch64` preset's suites and stepcore-demo with Debian's cross toolchain and runs
# them under qemu-aarch64 (the neon ISA; threads 1 and 3), then runs the demo there and
# natively with the same arguments and requires the same checksums and state hashes.
#
#   tools/run-aarch64.sh [NATIVE_DEMO]   (default build/default/apps/stepcore-demo)
#
# The suites run under the quick profile (tests/isa_list.hpp: every case, dtype and
# boundary size, fewer repeated steps), which keeps this part near 10 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
native_demo="${1:-build/default/apps/stepcore-demo}"
tools/install-deps.sh --aarch64

# The engine, reference, self-test, golden (both sets), primitive and p-norm suites, the
# managers (full offload and the other modes on the host device), and 8-bit state (the
# engine's and the kernels' block bodies on the executor).
suites=(test_cpu_engine test_reference test_cpu_self_test test_golden test_cpu_primitives
        test_norm_p test_managers test_q8 test_q8_engine test_q8_device)
cmake --preset aarch64 >/dev/null
cmake --build --preset aarch64 --target "${suites[@]}" stepcore-demo
echo "aarch64: cross build took $((SECONDS - start)) s"

# ctest names a test Suite.Case; take the suites of the binaries built here (the preset's
# other test binaries are not built, and their placeholders are not run).
emulator=(qemu-aarch64 -L /usr/aarch64-linux-gnu -E LD_LIBRARY_PATH=/usr/aarch64-linux-gnu/lib)
names=()
for t in "${suites[@]}"; do
  while IFS= read -r s; do names+=("$s"); done < <(
    "${emulator[@]}" build/aarch64/tests/"$t" --gtest_list_tests |
      awk '/^[A-Za-z_][A-Za-z0-9_\/]*\.( |$)/ { sub(/\..*/, ""); print }')
done
# (test_golden's second registration, the aarch64 set, carries the prefix aarch64-set/.)
STEPCORE_TEST_PROFILE=quick ctest --preset aarch64 \
  -R "^(aarch64-set/)?($(IFS='|'; echo "${names[*]}"))\\."
echo "aarch64: emulated suites done at $((SECONDS - start)) s"

# The demo: the engine phase checked against the reference, and the managers phase's
# "bitwise:" lines (modes none, optimizer and full on the host device, with and without
# overlap, resumed from a checkpoint). Its checksums must equal the native run's.
if [ ! -x "$native_demo" ]; then
  cmake --preset default >/dev/null
  cmake --build --preset default --target stepcore-demo
fi
# --torch-build aarch64: the aarch64 default, named so that the native run follows it too.
args=(--layers 1 --vocab 512 --steps 2 --micro-batches 2 --managers-vocab 512 --threads 3
      --no-bind --torch-build aarch64)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$native_demo" "${args[@]}" >"$tmp/native.txt"
STEPCORE_ISA=neon "${emulator[@]}" build/aarch64/apps/stepcore-demo "${args[@]}" >"$tmp/aarch64.txt"
grep '^bitwise:' "$tmp/aarch64.txt"
# The lines that must agree: the final state's checksums, and each "bitwise:" verdict with
# its state hash (the native run names its ISA where the emulated one says neon).
sums() { grep -E '^(checksum|bitwise: (managers|resumed))' "$1"; }
if ! diff <(sums "$tmp/native.txt") <(sums "$tmp/aarch64.txt"); then
  echo "aarch64: the demo's checksums differ from the native run's (above)" >&2
  exit 1
fi
echo "aarch64: demo checksums and state hashes equal the native run's"
echo "aarch64: everything took $((SECONDS - start)) s"
