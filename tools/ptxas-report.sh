#!/bin/sh
# Compiler launcher for the library's CUDA sources: runs the compile (the rest of the command
# line, ccache included when configured) and keeps ptxas's per-kernel resource report
# (-Xptxas=-v) in REPORT_DIR/<object name>.ptxas, where tools/check-kernel-resources.py reads
# it; every other line the compiler prints passes through (to stderr) unchanged.
# Usage: ptxas-report.sh REPORT_DIR COMMAND...
set -u
dir=$1
shift
obj=
prev=
for a in "$@"; do
  [ "$prev" = "-o" ] && obj=$a
  prev=$a
done
[ -n "$obj" ] || exec "$@"
mkdir -p "$dir" || exit 1
report="$dir/$(basename "$obj").ptxas"
"$@" >"$report.tmp" 2>&1
rc=$?
# ptxas -v writes "ptxas info : ..." lines and indented "N bytes stack frame, ..." lines.
grep -Ev '^ptxas info|^ +[0-9]+ bytes stack frame' "$report.tmp" >&2
if [ "$rc" -eq 0 ]; then mv "$report.tmp" "$report"; else rm -f "$report.tmp" "$report"; fi
exit "$rc"
