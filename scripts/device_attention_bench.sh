#!/usr/bin/env bash
# On the H200: builds moe-train and test_gpu_attention for sm_90, runs the attention tests, then
# the attention rows of `moe-train bench` at the bar's shapes (16 x 1024 and 4 x 4096 tokens,
# moe-small's heads) with each MOE_ATTENTION_SM90 setting, beside PyTorch's flash SDPA
# (scripts/sdpa_bench.py). With --ncu, also profiles one launch of each sm_90 backward kernel
# (Nsight Compute: speed of light, warp states). Prints a summary last; logs under $OUT.
#   scripts/device_attention_bench.sh [--ncu]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/attention}
mkdir -p "$OUT"
b=build-gpu-sm90
{ cmake -S . -B $b -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOE_CUDA=ON -DMOE_CUDA_ARCHS=90 &&
  cmake --build $b -j "$(nproc)" --target moe-train test_gpu_attention; } >"$OUT/build.log" 2>&1 ||
  { tail -30 "$OUT/build.log"; exit 1; }
timeout 300 $b/tests/test_gpu_attention --reporter compact >"$OUT/test.log" 2>&1
echo "test_gpu_attention: rc=$? $(tail -1 "$OUT/test.log")" >"$OUT/summary.txt"
long=(--set data.seq_len=4096 --set train_micro_batch_size_per_gpu=4
  --set model.max_position_embeddings=4096)
for sm90 in 0 1 unset; do
  for shape in short long; do
    extra=()
    [ $shape = long ] && extra=("${long[@]}")
    setting=(env -u MOE_ATTENTION_SM90)
    [ $sm90 = unset ] || setting=(env MOE_ATTENTION_SM90=$sm90)
    "${setting[@]}" $b/moe-train bench --config configs/moe-small.json --family attention \
      "${extra[@]}" >"$OUT/bench.$sm90.$shape.log" 2>&1
    grep -E "^attention" "$OUT/bench.$sm90.$shape.log" | sed "s/^/MOE_ATTENTION_SM90=$sm90 /" |
      cut -c1-110 >>"$OUT/summary.txt"
  done
done
python3 scripts/sdpa_bench.py >>"$OUT/summary.txt" 2>&1
if [ "${1:-}" = --ncu ]; then
  MOE_ATTENTION_SM90=1 timeout 300 ncu -k regex:flash_d --launch-count 2 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    $b/moe-train bench --config configs/moe-small.json --family attention_bwd --iters 1 \
    >"$OUT/ncu.log" 2>&1
  grep -E "flash_|Duration|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued|Achieved Occupancy|Stall|Registers Per" \
    "$OUT/ncu.log" | sed 's/(CUtensorMap.*//' | cut -c1-110 >>"$OUT/summary.txt"
fi
cat "$OUT/summary.txt"
