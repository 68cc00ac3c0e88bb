#!/usr/bin/env bash
# On a GPU machine, with scripts/wip/mod_select_few.patch applied (one device call, ~4-5 minutes
# cold): the MoD select microbenchmark's rows, then test_gpu_router_fused's mod_route cases with
# MOE_MOD_SELECT_SMALL 0 and 1, then the bench's MoD select rows with MOE_MOD_ROUTE_PDL /
# MOE_MOD_SELECT_SMALL at 1/0 (the trainer's form), 1/1 and 0/0 (one launch), twice. Logs under
# $OUT (default /tmp/mod_select_few).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/mod_select_few}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
t0=$SECONDS
b=build-gpu-sm90
(cmake -S . -B $b -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=ON -DMOE_CUDA_ARCHS=90 \
  >"$OUT/cmake.log" 2>&1 &&
  cmake --build $b -j "$(($(nproc) - 1))" --target moe-train test_gpu_router_fused test_gpu_mod \
    >"$OUT/build.log" 2>&1
echo $? >"$OUT/build.rc") &
nvcc -std=c++17 -O3 -arch=sm_90 -Iinclude -Ikernels -Isrc scripts/microbench/mod_select_parts.cu \
  -o /tmp/mod_select_parts >"$OUT/msp.build.log" 2>&1 &&
  timeout 60 /tmp/mod_select_parts >"$OUT/msp.txt" 2>&1
echo "microbenchmark rc=$? at $((SECONDS - t0)) s"
cat "$OUT/msp.txt"
wait
echo "build rc=$(cat "$OUT/build.rc" 2>/dev/null) at $((SECONDS - t0)) s"
for s in 0 1; do
  MOE_MOD_SELECT_SMALL=$s timeout 90 $b/tests/test_gpu_router_fused "gpu mod_route*" \
    --reporter compact -o "$OUT/router_fused.small$s.log"
  echo "test_gpu_router_fused mod_route SMALL=$s rc=$? $(tail -1 "$OUT/router_fused.small$s.log")"
done
timeout 150 $b/tests/test_gpu_mod --reporter compact -o "$OUT/test_gpu_mod.log"
echo "test_gpu_mod rc=$? $(tail -1 "$OUT/test_gpu_mod.log")"
for r in 1 2; do
  for v in "1 0" "1 1" "0 0"; do
    read -r pdl small <<<"$v"
    rows=$(MOE_MOD_ROUTE_PDL=$pdl MOE_MOD_SELECT_SMALL=$small timeout 30 $b/moe-train bench \
      --config configs/moe-small.json --family mod_select 2>&1 | grep mod_select | head -3 |
      tr -s ' ' | tr '\n' '|')
    echo "PDL=$pdl SMALL=$small: $rows"
  done
done
echo "all done at $((SECONDS - t0)) s"
