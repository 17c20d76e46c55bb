#!/usr/bin/env bash
# The long fuzz runs docs/reliability.md records: builds the fuzz preset's harnesses and
# runs each for N executions (default 10,000,000) from its committed seed corpus into a
# working corpus under build/fuzz/long/<harness>, as many harnesses at once as there are
# cores. Prints, per harness: executions, seconds, coverage (edges / features), corpus
# size and crash artifacts. Exits non-zero if any harness found a crash.
#
#   tools/run-fuzz.sh [--runs N] [--merge] [harness ...]     (default: every harness)
#
# --merge: afterwards, adds to tests/fuzz/corpus/<harness> the working inputs that bring
# coverage the committed corpus lacks (libFuzzer -merge=1; nothing is removed).
set -euo pipefail
cd "$(dirname "$0")/.."
runs=10000000 merge=0 harnesses=()
while [ $# -gt 0 ]; do
  case $1 in
    --runs) runs=$2; shift 2 ;;
    --merge) merge=1; shift ;;
    fuzz_*) harnesses+=("$1"); shift ;;
    *) echo "run-fuzz: unknown argument '$1' (--runs N, --merge, fuzz_<name>)" >&2; exit 2 ;;
  esac
done
[ ${#harnesses[@]} -eq 0 ] &&
  harnesses=(fuzz_norm fuzz_checkpoint fuzz_engine fuzz_manager fuzz_hf_config fuzz_safetensors)
jobs=$(nproc 2>/dev/null || echo 2)

tools/install-deps.sh --sanitizers
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz -j "$jobs" --target "${harnesses[@]}"

long=build/fuzz/long
one() {  # one HARNESS: its long run, output in $long/HARNESS.log
  local h=$1 work=$long/$1
  mkdir -p "$work" "$long/$h-artifacts"
  local start=$SECONDS rc=0
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 build/fuzz/tests/fuzz/"$h" \
    -runs="$runs" -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$long/$h-artifacts/" "$work" "tests/fuzz/corpus/$h" >"$long/$h.log" 2>&1 || rc=$?
  echo "seconds: $((SECONDS - start)) rc: $rc" >>"$long/$h.log"
}

mkdir -p "$long"
running=0
for h in "${harnesses[@]}"; do
  if [ "$running" -ge "$jobs" ]; then wait -n || true; running=$((running - 1)); fi
  echo "== $h: $runs executions (log: $long/$h.log)"
  one "$h" &
  running=$((running + 1))
done
wait

status=0
printf '%-18s %12s %8s %8s %10s %7s %s\n' harness executions seconds exec/s edges/ft corpus crashes
for h in "${harnesses[@]}"; do
  log=$long/$h.log
  execs=$(awk '/stat::number_of_executed_units/ { print $2 }' "$log")
  rate=$(awk '/stat::average_exec_per_sec/ { print $2 }' "$log")
  secs=$(awk '/^seconds:/ { print $2 }' "$log")
  last=$(grep -E '^#[0-9]+.*cov: ' "$log" | tail -1 || true)
  cov=$(sed -E 's/.*cov: ([0-9]+) ft: ([0-9]+).*/\1\/\2/' <<<"$last")
  corpus=$(sed -E 's/.*corp: ([0-9]+)\/.*/\1/' <<<"$last")
  crashes=$(find "$long/$h-artifacts" -type f | wc -l)
  printf '%-18s %12s %8s %8s %10s %7s %s\n' "$h" "${execs:-?}" "${secs:-?}" "${rate:-?}" \
    "${cov:-?}" "${corpus:-?}" "$crashes"
  [ "$crashes" -eq 0 ] && grep -q 'rc: 0' "$log" || status=1
  if [ "$merge" -eq 1 ]; then
    build/fuzz/tests/fuzz/"$h" -merge=1 "tests/fuzz/corpus/$h" "$long/$h" >"$long/$h-merge.log" 2>&1
    echo "   merged: $(grep -Eo 'MERGE-OUTER: [0-9]+ new files' "$long/$h-merge.log" || echo '?')"
  fi
done
exit $status
