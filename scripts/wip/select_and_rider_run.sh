#!/usr/bin/env bash
# On a GPU machine, with scripts/wip/mod_select_few.patch and scripts/wip/adam_rider_bulk.patch
# applied (one device call, ~7 minutes cold): builds; the MoD select microbenchmark; the
# mod_route tests with MOE_MOD_SELECT_SMALL 0/1; test_gpu_mod; the bulk riders' test; the bench
# rows (mod_select PDL/SMALL; adamw_rider on moe-fine and moe-small).
# Run in the 45th session on an H100 (docs/perf.md): neither form kept; the patches stay as the
# record.
set -uo pipefail
OUT=${OUT:-/tmp/rider_bulk}
cd "$(dirname "$0")/../.." || exit 1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
t0=$SECONDS
b=build-gpu-sm90
(cmake -S . -B $b -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=ON -DMOE_CUDA_ARCHS=90 \
  >"$OUT/cmake.log" 2>&1 &&
  cmake --build $b -j 15 --target moe-train test_gpu_router_fused test_gpu_mod \
    test_gpu_split_master >"$OUT/build.log" 2>&1
  echo $? >"$OUT/build.rc") &
nvcc -std=c++17 -O3 -arch=sm_90 -Iinclude -Ikernels -Isrc scripts/microbench/mod_select_parts.cu \
  -o /tmp/msp >"$OUT/msp.build.log" 2>&1 && timeout 60 /tmp/msp >"$OUT/msp.txt" 2>&1
echo "msp rc=$? at $((SECONDS - t0)) s"
cat "$OUT/msp.txt" | tail -20
wait
echo "build rc=$(cat $OUT/build.rc 2>/dev/null) at $((SECONDS - t0)) s"
tail -3 "$OUT/build.log" | cut -c1-300
for s in 0 1; do
  MOE_MOD_SELECT_SMALL=$s timeout 90 $b/tests/test_gpu_router_fused "gpu mod_route*" \
    --reporter compact -o "$OUT/rf$s.log"
  echo "router_fused mod_route SMALL=$s rc=$? $(tail -1 "$OUT/rf$s.log")"
done
timeout 120 $b/tests/test_gpu_mod --reporter compact -o "$OUT/mod.log"
echo "test_gpu_mod rc=$? $(tail -1 "$OUT/mod.log")"
timeout 90 $b/tests/test_gpu_split_master "gpu grouped_linear_forward_adamw*" --reporter compact \
  -o "$OUT/rider.log"
echo "rider test rc=$? $(tail -2 "$OUT/rider.log" | tr '\n' ' ')"
echo "tests at $((SECONDS - t0)) s"
for r in 1 2; do
  for v in "1 0" "1 1" "0 0"; do
    set -- $v
    row=$(MOE_MOD_ROUTE_PDL=$1 MOE_MOD_SELECT_SMALL=$2 timeout 40 $b/moe-train bench \
      --config configs/moe-small.json --family mod_select 2>&1)
    echo "PDL=$1 SMALL=$2: $(grep mod_select <<<"$row" | head -3 | tr -s ' ' | tr '\n' '|')"
  done
done
for c in moe-fine moe-small; do
  timeout 60 $b/moe-train bench --config configs/$c.json --family grouped_gemm adamw_split \
    adamw_rider >"$OUT/rider.$c.txt" 2>&1
  echo "== $c rc=$?"
  grep -E "grouped_gemm .*maxvio 0 |adamw" "$OUT/rider.$c.txt" | tr -s ' ' | cut -c1-200
done
echo "all done at $((SECONDS - t0)) s"
