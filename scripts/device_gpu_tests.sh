#!/usr/bin/env bash
# On a GPU machine: builds the CUDA backend for the local GPU (and, with --sm75, a PTX-only sm_75
# build that the driver JIT-compiles, to check the T4 code path), runs the GPU tests and prints a
# summary table. Logs go to $OUT (default /tmp/gpu_tests).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_tests}
mkdir -p "$OUT"
gen=$(command -v ninja >/dev/null && echo "-G Ninja")
summary=()
run_suite() {  # name archs
  local name=$1 archs=$2 dir=build-gpu-$1
  cmake -S . -B "$dir" $gen -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=ON -DMOE_CUDA_ARCHS="$archs" \
    >"$OUT/$name.cmake.log" 2>&1 || { summary+=("$name: cmake failed"); return; }
  local targets
  targets=$(ls tests/test_gpu_*.cpp | xargs -n1 basename | sed 's/\.cpp$//' | tr '\n' ' ')
  cmake --build "$dir" -j "$(nproc)" --target $targets >"$OUT/$name.build.log" 2>&1 ||
    { summary+=("$name: build failed (see $name.build.log)"); tail -30 "$OUT/$name.build.log"; return; }
  for t in $targets; do
    timeout "${TEST_TIMEOUT:-300}" "$dir/tests/$t" --reporter compact >"$OUT/$name.$t.log" 2>&1
    local rc=$?
    summary+=("$name $t: rc=$rc $(tail -1 "$OUT/$name.$t.log")")
  done
}
# --sm75: both builds; --sm75-only: the PTX-only sm_75 build alone
if [ "${1:-}" != "--sm75-only" ]; then run_suite sm90 90; fi
if [ "${1:-}" = "--sm75" ] || [ "${1:-}" = "--sm75-only" ]; then run_suite sm75ptx 75-virtual; fi
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
