#!/usr/bin/env bash
# Runs mpi_killed_rank on NP ranks under mpirun with --enable-recovery (a dead rank does
# not end the job, so the survivors' own timeouts are what stops them) and checks that
# every survivor reported Errc::timeout in time. Prints the time to error per rank.
#   run_killed_rank.sh MPIEXEC NP BINARY [mpiexec flags...]
set -uo pipefail
mpiexec=$1 np=$2 binary=$3
shift 3
start=$SECONDS
out=$(timeout 120 "$mpiexec" -np "$np" --enable-recovery "$@" "$binary" 1500 2>&1)
echo "$out" | grep -v "PMIX ERROR"
ok=$(echo "$out" | grep -c "timeout after .* ms (in time)")
echo "survivors reporting a timeout in time: $ok of $((np - 1)); the job took $((SECONDS - start)) s"
[ "$ok" -eq $((np - 1)) ]
