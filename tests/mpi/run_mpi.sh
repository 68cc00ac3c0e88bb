#!/usr/bin/env bash
# Runs a multi-rank test under mpirun for ctest (registered by tests/mpi/mpi_tests.cmake).
#   run_mpi.sh MPIEXEC NP EXE ARGS...
#       passes when the job exits 0
#   run_mpi.sh MPIEXEC NP EXE ARGS... --expect-failure REGEX MAX_SECONDS [--not REGEX]
#       passes when the job exits non-zero within MAX_SECONDS and its output matches REGEX
#       (grep -E), and does not match the --not REGEX
# Open MPI gets --oversubscribe (4 ranks on a 2-core box), --bind-to none, and
# --allow-run-as-root when run as root. Every run is capped by `timeout`, so a hang fails the
# test instead of stalling ctest.
set -uo pipefail

mpiexec=$1 np=$2 exe=$3
shift 3
prog_args=()
expect_regex="" max_seconds="" not_regex=""
while [ $# -gt 0 ]; do
  case "$1" in
    --expect-failure) expect_regex=$2 max_seconds=$3; shift 3 ;;
    --not) not_regex=$2; shift 2 ;;
    *) prog_args+=("$1"); shift ;;
  esac
done

launch=("$mpiexec")
if "$mpiexec" --version 2>&1 | grep -Eq "Open MPI|OpenRTE|open-mpi.org"; then
  launch+=(--oversubscribe --bind-to none)
  if [ "$(id -u)" = 0 ]; then launch+=(--allow-run-as-root); fi
fi
launch+=(-np "$np" "$exe" "${prog_args[@]}")

log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s.%N)
timeout -k 5 120 "${launch[@]}" >"$log" 2>&1
rc=$?
elapsed=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
cat "$log"
echo "run_mpi.sh: ${launch[*]} -> exit $rc after ${elapsed} s"

if [ -z "$expect_regex" ]; then
  exit "$rc"
fi
fail() { echo "run_mpi.sh: FAILED: $*"; exit 1; }
[ "$rc" -ne 0 ] || fail "expected a non-zero exit"
case "$rc" in 124 | 137) fail "the job hung until timeout(1) killed it" ;; esac
grep -Eq -- "$expect_regex" "$log" || fail "no output line matches: $expect_regex"
if [ -n "$not_regex" ] && grep -Eq -- "$not_regex" "$log"; then
  fail "output matches what it must not: $not_regex"
fi
awk -v e="$elapsed" -v m="$max_seconds" 'BEGIN { exit !(e < m) }' ||
  fail "took ${elapsed} s, bound ${max_seconds} s"
echo "run_mpi.sh: failed as expected"
