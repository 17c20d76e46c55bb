#!/usr/bin/env bash
# Fails when a file of the library includes from a layer above its own, or sideways, or
# when a source file of the library or the Python package is longer than 800 lines.
# The layers, bottom to top, and what each may include (besides system headers and the
# public headers "stepcore/..."); every internal include is written from the project
# root, so its first folder names its layer. Public headers include only public headers.
#
#   include/stepcore  the public API (what an integrator calls)
#   core              types' implementation, validation, scalar preparation, formulas
#   reference         the scalar reference                  may include: core
#   host              NUMA topology, placed/pinned memory   may include: core
#   cpu               the SIMD engine                       may include: core host
#   kernels           block bodies, plans, executor, CUDA   may include: core
#   comm              communicators, global norm            may include: core host cpu
#   device            host device, CUDA device              may include: core host kernels
#   managers          the gradient managers                 may include: every layer below
#   diff              the comparer (recordings, safetensors) may include: core host
#   apps tools bench tests on top: anything (apps: the shipped programs; tools: the
#                     build and check scripts)
#   python/src        the Python extension: a thin binding, public headers only
#
# No file of a layer, of include/ or of the Python package (python/src, python/stepcore)
# is longer than kMaxLines (800): a longer one holds more than one concern to split.
#
#   tools/check-layers.sh [ROOT [includes|lengths]]   (both checks by default; exit 0:
#   clean; 1: violations, each printed)
set -uo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
what=${2:-all}
cd "$root" || exit 2
case $what in
  all | includes | lengths) ;;
  *) echo "check-layers: unknown check '$what' (includes, lengths)" >&2; exit 2 ;;
esac

declare -A allowed=(
  [core]=""
  [reference]="core"
  [host]="core"
  [cpu]="core host"
  [kernels]="core"
  [comm]="core host cpu"
  [device]="core host kernels"
  [managers]="core reference host cpu kernels comm device"
  [diff]="core host"
)
internal=" ${!allowed[*]} "
bad=0
files=0     # files whose includes were checked
measured=0  # files whose length was checked

report() {
  echo "check-layers: $1" >&2
  bad=$((bad + 1))
}

# Files that may include public headers only: the public headers themselves, and the
# Python extension (a thin binding of the public API, as an integrator would write; its
# own headers beside it, named without a folder, are its own).
public_only() {  # <folder> <who, for the message> <own headers: yes|no> <find -name patterns...>
  local dir=$1 who=$2 own=$3
  shift 3
  [ -d "$dir" ] || return 0
  while IFS= read -r -d '' f; do
    files=$((files + 1))
    while IFS=: read -r line inc; do
      case $inc in
        stepcore/*) ;;
        */*) report "$f:$line: $who includes \"$inc\" (public headers only)" ;;
        *) if [ "$own" = yes ] && [ -f "$dir/$inc" ]; then :; else
             report "$f:$line: $who includes \"$inc\" (public headers only)"; fi ;;
      esac
    done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" |
             sed -E 's/^([0-9]+):[^"]*"([^"]+)".*/\1:\2/')
  done < <(find "$dir" -type f \( "$@" \) -print0)
}

check_includes() {
  # Library layers: every quoted include is public or from an allowed lower layer.
  for layer in "${!allowed[@]}"; do
    [ -d "$layer" ] || { report "layer folder '$layer' is missing"; continue; }
    while IFS= read -r -d '' f; do
      files=$((files + 1))
      while IFS=: read -r line inc; do
        case $inc in
          stepcore/*) continue ;;
        esac
        target=${inc%%/*}
        if [ "$target" = "$inc" ]; then
          report "$f:$line: \"$inc\" is not written from the project root (\"$layer/$inc\"?)"
        elif [ "$target" = "$layer" ]; then
          :
        elif [[ $internal == *" $target "* ]]; then
          [[ " ${allowed[$layer]} " == *" $target "* ]] ||
            report "$f:$line: $layer includes \"$inc\" from layer $target, which is not below it"
        else
          report "$f:$line: $layer includes \"$inc\", outside the library's layers"
        fi
      done < <(grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" |
               sed -E 's/^([0-9]+):[^"]*"([^"]+)".*/\1:\2/')
    done < <(find "$layer" -type f \( -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' \) -print0)
  done

  public_only include "a public header" no -name '*.hpp'
  public_only python/src "the Python extension" yes -name '*.cpp' -o -name '*.hpp'

  # No stray source folder outside the layers and the top floor.
  for d in */; do
    d=${d%/}
    case " $d " in
      " include " | " apps " | " tools " | " bench " | " tests " | " docs " | " cmake " | " build " | " python " | " shared ") ;;
      *) [[ $internal == *" $d "* ]] ||
           { find "$d" -type f \( -name '*.cpp' -o -name '*.cu' \) | grep -q . &&
               report "folder '$d' holds sources but is not a layer"; } ;;
    esac
  done
}

# No long file in the library, its public headers or the Python package.
kMaxLines=800
check_lengths() {
  local f lines
  while IFS= read -r -d '' f; do
    measured=$((measured + 1))
    lines=$(wc -l <"$f")
    [ "$lines" -le $kMaxLines ] ||
      report "$f: $lines lines, more than $kMaxLines: split it by concern"
  done < <(find "${!allowed[@]}" include python/src python/stepcore -type f \
             \( -name '*.cpp' -o -name '*.hpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.py' \) \
             -print0 2>/dev/null)
}

said=()
if [ "$what" != lengths ]; then
  check_includes
  said+=("$files files, every include points down")
fi
if [ "$what" != includes ]; then
  check_lengths
  said+=("$measured files, none over $kMaxLines lines")
fi
if [ $bad -ne 0 ]; then
  echo "check-layers: $bad violation(s)" >&2
  exit 1
fi
for line in "${said[@]}"; do echo "check-layers: $line"; done
