#!/usr/bin/env bash
# On a GPU machine: builds the CUDA backend for the local GPU (and, with --sm75, a PTX-only sm_75
# build that the driver JIT-compiles, to check the T4 code path), runs the GPU tests and prints a
# summary table. With --sanitize, also runs compute-sanitizer memcheck and racecheck over every
# GPU test of the local-GPU build (or of those named in SANITIZE_TESTS). Logs go to $OUT (default
# /tmp/gpu_tests).
#   scripts/device_gpu_tests.sh [--sm75 | --sm75-only] [--sanitize]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_tests}
mkdir -p "$OUT"
gen=$(command -v ninja >/dev/null && echo "-G Ninja")
local_gpu=1 sm75=0 sanitize=0
for a in "$@"; do
  case $a in
    --sm75) sm75=1 ;;
    --sm75-only) sm75=1 local_gpu=0 ;;
    --sanitize) sanitize=1 ;;
    *) echo "unknown option $a" >&2; exit 2 ;;
  esac
done
targets=$(ls tests/test_gpu_*.cpp | xargs -n1 basename | sed 's/\.cpp$//' | tr '\n' ' ')
summary=()
suites=()
[ $local_gpu = 1 ] && suites+=("sm90:90")
[ $sm75 = 1 ] && suites+=("sm75ptx:75-virtual")
# Build every suite at once (the cores are shared), then run the tests one suite after another.
jobs=$(($(nproc) / ${#suites[@]}))
want_gen=$([ -n "$gen" ] && echo Ninja || echo "Unix Makefiles")
for s in "${suites[@]}"; do
  name=${s%%:*} archs=${s#*:}
  # A build folder configured by another generator (a hand-run cmake) makes cmake refuse: start
  # that one afresh.
  cache="build-gpu-$name/CMakeCache.txt"
  if [ -f "$cache" ] && ! grep -qx "CMAKE_GENERATOR:INTERNAL=$want_gen" "$cache"; then
    rm -rf "build-gpu-$name"
  fi
  (cmake -S . -B "build-gpu-$name" $gen -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=ON \
    -DMOE_CUDA_ARCHS="$archs" >"$OUT/$name.cmake.log" 2>&1 &&
    cmake --build "build-gpu-$name" -j "$jobs" --target $targets moe-train >"$OUT/$name.build.log" 2>&1
  echo $? >"$OUT/$name.build.rc") &
done
wait
for s in "${suites[@]}"; do
  name=${s%%:*}
  if [ "$(cat "$OUT/$name.build.rc")" != 0 ]; then
    summary+=("$name: build failed (see $name.build.log)")
    tail -30 "$OUT/$name.build.log"
    continue
  fi
  for t in $targets; do
    timeout "${TEST_TIMEOUT:-300}" "build-gpu-$name/tests/$t" --reporter compact >"$OUT/$name.$t.log" 2>&1
    summary+=("$name $t: rc=$? $(tail -1 "$OUT/$name.$t.log")")
  done
done
if [ $sanitize = 1 ] && [ $local_gpu = 1 ]; then
  for tool in memcheck racecheck; do
    extra=()
    [ $tool = racecheck ] && extra=(--racecheck-report hazard)
    for t in ${SANITIZE_TESTS:-$targets}; do
      log="$OUT/sanitize.$tool.$t.log"
      timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool $tool "${extra[@]}" --error-exitcode 9 \
        "build-gpu-sm90/tests/$t" --reporter compact >"$log" 2>&1
      summary+=("$tool $t: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)")
    done
  done
fi
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
